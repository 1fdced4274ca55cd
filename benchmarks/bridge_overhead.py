"""Per-call overhead of art_trio's bridge, in microseconds.

    python benchmarks/bridge_overhead.py [--calls 20000]
    python benchmarks/bridge_overhead.py --floor     # the overhead row's floor

Times `Bridge.call` on an asyncio coroutine function that returns at once (so only the
crossing is measured) under trio (through trio-asyncio) and under asyncio (a plain await),
and `Bridge.callback` on a `trio_native` function for comparison.

`--floor`: what the README's overhead-b32 row could reach with a scheduler that cost nothing.
The workload's rollout double alone, called by 64 concurrent callers with no trainer (asyncio
tasks awaiting it; trio tasks crossing the bridge to it), beside ART's trainer and art_trio's
on the same workload in the same process: microseconds per group, median of the repeats.
Each trainer's scheduler costs its figure minus the double's under the same conditions: for
art_trio with the collector frozen, as `train()` runs (`facade/supervision.py`; full
collections otherwise walk every object the imports made, ~30 us a group here under trio),
for ART as it runs, without.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import anyio

from art_trio.plumbing.bridge.calls import open_bridge, trio_native

#: Groups each floor run makes (the overhead-b32 workload's 2,000 steps of 32).
FLOOR_GROUPS = 64_000
#: The floor's runs: name, loop, collector frozen.
FLOOR_RUNS = (
    ("the double alone, asyncio", "asyncio", False),
    ("the double alone, asyncio, collector frozen", "asyncio", True),
    ("the double alone, bridged, collector frozen", "trio", True),
)


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


async def double_alone(workers: int, frozen: bool) -> float:
    """Microseconds per group of overhead-b32's rollout double, `workers` callers at once,
    through the bridge under trio and awaited in place under asyncio; `frozen`: with the
    objects made before it kept from the collector."""
    from art_trio.sim.doubles import make_rollout_fn
    from art_trio.sim.recorder import Recorder
    from art_trio.sim.workloads import PRESETS

    rollout = make_rollout_fn(PRESETS["overhead-b32"], Recorder(), flavor="asyncio")
    indices = iter(range(FLOOR_GROUPS))
    async with open_bridge() as bridge:

        async def caller() -> None:
            for i in indices:
                await bridge.callback(rollout, None, {"id": i}, None)

        if frozen:
            gc.freeze()
        try:
            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for _ in range(workers):
                    group.start_soon(caller)
            return (time.perf_counter() - started) / FLOOR_GROUPS * 1e6
        finally:
            gc.unfreeze()


def floor(repeats: int) -> None:
    from art_trio.bench.trainers import run_one
    from art_trio.sim.workloads import PRESETS

    workload = PRESETS["overhead-b32"]
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for kind in ("art", "trio", "asyncio"):
            per_s = run_one(kind, workload).to_dict()["groups_per_s"]
            samples.setdefault(kind, []).append(1e6 / per_s)
        for name, backend, frozen in FLOOR_RUNS:
            samples.setdefault(name, []).append(
                anyio.run(double_alone, workload.workers, frozen, backend=backend)
            )
    us = {name: statistics.median(values) for name, values in samples.items()}
    print(f"| overhead-b32 (median of {repeats}) | us per group | its scheduler's share |")
    print("|---|---|---|")
    for name, _, _ in FLOOR_RUNS:
        print(f"| {name} | {us[name]:.0f} | |")
    art = us["art"]
    for label, kind, floor_name in (
        ("ART's trainer", "art", "the double alone, asyncio"),
        ("art_trio, asyncio", "asyncio", "the double alone, asyncio, collector frozen"),
        ("art_trio, bridged", "trio", "the double alone, bridged, collector frozen"),
    ):
        print(f"| {label} | {us[kind]:.0f} | {us[kind] - us[floor_name]:.0f} |")
    bridged = art - us["the double alone, bridged, collector frozen"]
    on_asyncio = art / 1.2 - us["the double alone, asyncio, collector frozen"]
    print(
        f"For 1.0x ART's groups/s bridged, art_trio's scheduler may cost {bridged:.0f} us a "
        f"group; for 1.2x on asyncio, {on_asyncio:.0f} us (ART's costs "
        f"{art - us['the double alone, asyncio']:.0f})."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--floor", action="store_true", help="the overhead row's floor")
    args = parser.parse_args()
    if args.floor:
        floor(args.repeats)
        return
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
