"""art_trio's groups queue against anyio's memory object stream, per item (see README.md).

    python benchmarks/group_queue_bench.py [--items 20000] [--repeats 7]

Three shapes, each on trio and on asyncio (anyio.run), each timing one item's send and
receive (best of the repeats, ns per item):

- `nowait`: one task, `send_nowait` then `receive_nowait` (capacity 64): the bookkeeping alone.
- `full`: 8 senders `await send` into capacity 4, one receiver `await receive`: senders
  block on a full queue and are let in as the receiver takes (the pipeline's hand-over when
  the trainer is the bottleneck).
- `empty`: one receiver waiting on an empty queue, one sender handing over and yielding
  (the hand-over when rollouts are the bottleneck).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from art_trio.plumbing.group_queue import GroupQueue

Ends = tuple[Any, Any]


def anyio_stream(capacity: int) -> Ends:
    return anyio.create_memory_object_stream[int](capacity)


def group_queue(capacity: int) -> Ends:
    queue = GroupQueue[int](capacity)
    return queue.send_end, queue.receive_end


async def nowait(make: Callable[[int], Ends], n: int) -> float:
    send, receive = make(64)
    started = time.perf_counter()
    for i in range(n):
        send.send_nowait(i)
        receive.receive_nowait()
    return time.perf_counter() - started


async def full(make: Callable[[int], Ends], n: int) -> float:
    send, receive = make(4)
    senders = 8

    async def sender(ends: Any, count: int) -> None:
        async with ends:
            for i in range(count):
                await ends.send(i)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(senders):
            tg.start_soon(sender, send.clone(), n // senders)
        send.close()
        async for _ in receive:
            pass
    return time.perf_counter() - started


async def empty(make: Callable[[int], Ends], n: int) -> float:
    send, receive = make(4)

    async def receiver() -> None:
        async for _ in receive:
            pass

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        async with send:
            for i in range(n):
                send.send_nowait(i)
                await anyio.lowlevel.checkpoint()
    return time.perf_counter() - started


SHAPES: dict[str, Callable[[Callable[[int], Ends], int], Awaitable[float]]] = {
    "nowait": nowait, "full": full, "empty": empty,
}
KINDS = {"anyio stream": anyio_stream, "GroupQueue": group_queue}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"ns per item, best of {args.repeats} x {args.items} items")
    print("| loop | shape | anyio stream | GroupQueue | ratio |")
    print("|---|---|---|---|---|")
    for loop in ("trio", "asyncio"):
        for shape, fn in SHAPES.items():
            best = {kind: float("inf") for kind in KINDS}
            for _ in range(args.repeats):
                for kind, make in KINDS.items():  # interleaved: load drifts hit both
                    seconds = anyio.run(fn, make, args.items, backend=loop)
                    best[kind] = min(best[kind], seconds / args.items * 1e9)
            a, g = best["anyio stream"], best["GroupQueue"]
            print(f"| {loop} | {shape} | {a:.0f} | {g:.0f} | {g / a:.2f} |")


if __name__ == "__main__":
    main()
