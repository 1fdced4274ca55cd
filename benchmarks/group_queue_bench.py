"""art_trio's groups queue against anyio's memory object stream, per item (see README.md).

    python benchmarks/group_queue_bench.py [--items 20000] [--repeats 7]

Three kinds: anyio's bounded memory object stream (what carried the groups before; its
capacity cannot change through its public API), `GroupQueue`, and the replacement issue 52
weighed, from anyio's public API alone: an unbounded memory object stream behind a
`CapacityLimiter` (the bound, resizable through `total_tokens`), with the record of queued
items and when each was offered that the metrics and the stall report read
(`stream+limiter`). Three shapes, each on trio and on asyncio (anyio.run), each timing one
item's send and receive (best of the repeats, ns per item):

- `nowait`: one task, `send_nowait` then `receive_nowait` (capacity 64): the bookkeeping alone.
- `full`: 8 senders `await send` into capacity 4, one receiver `await receive`: senders
  block on a full queue and are let in as the receiver takes (the pipeline's hand-over when
  the trainer is the bottleneck).
- `empty`: one receiver waiting on an empty queue, one sender handing over and yielding
  (the hand-over when rollouts are the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import sniffio

from art_trio.plumbing.group_queue import GroupQueue

Ends = tuple[Any, Any]


def anyio_stream(capacity: int) -> Ends:
    return anyio.create_memory_object_stream[int](capacity)


def group_queue(capacity: int) -> Ends:
    queue = GroupQueue[int](capacity)
    return queue.send_end, queue.receive_end


class LimitedSend:
    """A send end of `stream_limiter`: a slot from the limiter (waiting for one while the
    bound is reached), then the item into the unbounded stream and the record."""

    def __init__(self, send: Any, room: Any, record: dict[Any, float], now: Any) -> None:
        self.send_end, self.room, self.record, self.now = send, room, record, now

    def send_nowait(self, item: Any) -> None:
        self.room.acquire_on_behalf_of_nowait(item)
        self.send_end.send_nowait(item)
        self.record[item] = self.now()

    async def send(self, item: Any) -> None:
        offered = self.now()
        try:
            self.room.acquire_on_behalf_of_nowait(item)
        except anyio.WouldBlock:
            await self.room.acquire_on_behalf_of(item)
        else:
            await anyio.lowlevel.checkpoint()
        self.send_end.send_nowait(item)
        self.record[item] = offered

    def clone(self) -> LimitedSend:
        return LimitedSend(self.send_end.clone(), self.room, self.record, self.now)

    def close(self) -> None:
        self.send_end.close()

    async def __aenter__(self) -> LimitedSend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class LimitedReceive:
    """The receive end of `stream_limiter`: the item, its slot given back, its record gone."""

    def __init__(self, receive: Any, room: Any, record: dict[Any, float]) -> None:
        self.receive_end, self.room, self.record = receive, room, record

    def receive_nowait(self) -> Any:
        item = self.receive_end.receive_nowait()
        self.room.release_on_behalf_of(item)
        del self.record[item]
        return item

    async def receive(self) -> Any:
        item = await self.receive_end.receive()
        self.room.release_on_behalf_of(item)
        del self.record[item]
        return item

    def __aiter__(self) -> LimitedReceive:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


def stream_limiter(capacity: int) -> Ends:
    """anyio's public API alone: an unbounded stream, bounded by a CapacityLimiter (items are
    the borrowers: they must be distinct), timed on the loop's own clock as GroupQueue is."""
    send, receive = anyio.create_memory_object_stream[int](float("inf"))
    room, record = anyio.CapacityLimiter(capacity), dict[Any, float]()
    if sniffio.current_async_library() == "trio":
        import trio

        now = trio.lowlevel.current_clock().current_time
    else:
        now = asyncio.get_running_loop().time
    return LimitedSend(send, room, record, now), LimitedReceive(receive, room, record)


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

    async def sender(ends: Any, first: int, count: int) -> None:
        async with ends:
            for i in range(first, first + count):  # distinct items (stream_limiter's keys)
                await ends.send(i)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(senders):
            tg.start_soon(sender, send.clone(), k * (n // senders), n // senders)
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
KINDS = {
    "anyio stream": anyio_stream, "GroupQueue": group_queue, "stream+limiter": stream_limiter,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"ns per item, best of {args.repeats} x {args.items} items")
    print("| loop | shape | anyio stream | GroupQueue | stream+limiter | GroupQueue / stream "
          "| stream+limiter / GroupQueue |")
    print("|---|---|---|---|---|---|---|")
    for loop in ("trio", "asyncio"):
        for shape, fn in SHAPES.items():
            best = {kind: float("inf") for kind in KINDS}
            for _ in range(args.repeats):
                for kind, make in KINDS.items():  # interleaved: load drifts hit both
                    seconds = anyio.run(fn, make, args.items, backend=loop)
                    best[kind] = min(best[kind], seconds / args.items * 1e9)
            a, g, lim = best["anyio stream"], best["GroupQueue"], best["stream+limiter"]
            print(f"| {loop} | {shape} | {a:.0f} | {g:.0f} | {lim:.0f} | {g / a:.2f} "
                  f"| {lim / g:.2f} |")


if __name__ == "__main__":
    main()
