"""Per-call overhead of art_trio's bridge, in microseconds.

    python benchmarks/bridge_overhead.py [--calls 20000]

Times `Bridge.call` on an asyncio coroutine function that returns at once (so only the
crossing is measured) under trio (through trio-asyncio) and under asyncio (a plain await),
and `Bridge.callback` on a `trio_native` function for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from art_trio.plumbing.bridge import open_bridge, trio_native


async def asyncio_noop() -> int:
    # Asyncio code (the bridge treats unmarked callbacks as asyncio) that returns at once.
    return 1


@trio_native
async def native_noop() -> int:
    return 1


async def measure(calls: int, native: bool) -> float:
    async with open_bridge() as bridge:
        fn = native_noop if native else asyncio_noop
        for _ in range(200):  # warm up
            await bridge.callback(fn)
        started = time.perf_counter()
        for _ in range(calls):
            await bridge.callback(fn)
        return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [
        ("trio, asyncio callback via trio-asyncio", "trio", False),
        ("trio, trio_native callback (no bridge)", "trio", True),
        ("asyncio, asyncio callback (plain await)", "asyncio", False),
    ]
    print(f"| loop and callback | us per call (median of {args.repeats}) |")
    print("|---|---|")
    for label, backend, native in rows:
        samples = [
            anyio.run(measure, args.calls, native, backend=backend) for _ in range(args.repeats)
        ]
        print(f"| {label} | {statistics.median(samples):.1f} |")


if __name__ == "__main__":
    main()
