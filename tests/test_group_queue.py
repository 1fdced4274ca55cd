"""The groups queue (art_trio.plumbing.group_queue) on trio and on asyncio: order, blocking, ends,
cancellation, resizing and statistics. No sleeps: tasks are settled with
`anyio.wait_all_tasks_blocked()`, ages are read on trio's MockClock or an injected clock."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from art_trio.plumbing.group_queue import GroupQueue, GroupQueueStatistics

LOOPS = pytest.mark.parametrize("loop", ["trio", "asyncio"])


def run(loop: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    async def guarded() -> Any:
        with anyio.fail_after(60):  # a lost wake-up fails the test instead of hanging it
            return await fn()

    return anyio.run(guarded, backend=loop)


settle = anyio.wait_all_tasks_blocked


class Outcome:
    """What one task's send or receive ended with."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False


async def sending(end: Any, item: Any, out: Outcome) -> None:
    try:
        await end.send(item)
    except BaseException as exc:
        out.error = exc
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            raise
    finally:
        out.done = True


async def receiving(end: Any, out: Outcome) -> None:
    try:
        out.value = await end.receive()
    except BaseException as exc:
        out.error = exc
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            raise
    finally:
        out.done = True


def drain(queue: GroupQueue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(queue.receive_end.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return items


# -- order and blocking -------------------------------------------------------------------


@LOOPS
def test_items_come_out_in_order_and_a_full_queue_refuses_send_nowait(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](3)
        for i in range(3):
            queue.send_end.send_nowait(i)
        with pytest.raises(anyio.WouldBlock):
            queue.send_end.send_nowait(3)
        assert queue.queued() == (0, 1, 2)
        assert [await queue.receive_end.receive() for _ in range(3)] == [0, 1, 2]
        with pytest.raises(anyio.WouldBlock):
            queue.receive_end.receive_nowait()

    run(loop, main)


@LOOPS
def test_blocked_senders_get_in_first_come_first_served_before_later_senders(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](1)
        queue.send_end.send_nowait("x")
        outs = [Outcome() for _ in range(3)]
        async with anyio.create_task_group() as tg:
            for item, out in zip("abc", outs, strict=True):
                tg.start_soon(sending, queue.send_end, item, out)
                await settle()  # each blocks in turn: a, then b, then c
            assert queue.statistics().waiting_senders == 3
            assert queue.receive_end.receive_nowait() == "x"
            # a moved in at once; a later send_nowait does not jump the queue.
            assert queue.queued() == ("a",)
            with pytest.raises(anyio.WouldBlock):
                queue.send_end.send_nowait("late")
            received = [await queue.receive_end.receive() for _ in range(3)]
        assert received == ["a", "b", "c"]
        assert all(out.done and out.error is None for out in outs)

    run(loop, main)


@LOOPS
def test_a_receiver_waits_while_the_queue_is_empty(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](2)
        first, second = Outcome(), Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiving, queue.receive_end, first)
            await settle()
            tg.start_soon(receiving, queue.receive_end, second)
            await settle()
            assert not first.done and queue.statistics().waiting_receivers == 2
            queue.send_end.send_nowait(1)  # to the first receiver directly
            queue.send_end.send_nowait(2)
            assert queue.queued() == ()
        assert (first.value, second.value) == (1, 2)

    run(loop, main)


@LOOPS
def test_capacity_zero_is_a_rendezvous(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](0)
        with pytest.raises(anyio.WouldBlock):
            queue.send_end.send_nowait(1)  # nobody receiving
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending, queue.send_end, 7, out)
            await settle()
            assert not out.done and queue.statistics().queued == 0
            assert queue.receive_end.receive_nowait() == 7  # straight from the sender
        assert out.done and out.error is None
        receiver = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiving, queue.receive_end, receiver)
            await settle()
            queue.send_end.send_nowait(8)  # a receiver waits: handed over
        assert receiver.value == 8

    run(loop, main)


# -- ends ---------------------------------------------------------------------------------


@LOOPS
def test_the_receiver_sees_the_end_once_every_send_end_is_closed(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](4)
        clone = queue.send_end.clone()
        clone.send_nowait(1)
        queue.send_end.close()
        out = Outcome()
        async with anyio.create_task_group() as tg:
            assert await queue.receive_end.receive() == 1
            tg.start_soon(receiving, queue.receive_end, out)
            await settle()
            assert not out.done  # a clone is still open
            clone.send_nowait(2)
        assert out.value == 2
        clone.send_nowait(3)
        await clone.aclose()
        assert queue.statistics().open_send_ends == 0
        assert [item async for item in queue.receive_end] == [3]  # then EndOfStream
        with pytest.raises(anyio.EndOfStream):
            queue.receive_end.receive_nowait()

    run(loop, main)


@LOOPS
def test_a_waiting_receiver_gets_end_of_stream_when_the_last_send_end_closes(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](1)
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiving, queue.receive_end, out)
            await settle()
            async with queue.send_end:
                pass
        assert isinstance(out.error, anyio.EndOfStream)

    run(loop, main)


@LOOPS
def test_closing_the_receive_end_breaks_senders_as_anyios_streams_do(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](1)
        queue.send_end.send_nowait(0)
        worker = queue.send_end.clone()
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending, worker, 1, out)
            await settle()
            queue.receive_end.close()
        assert isinstance(out.error, anyio.BrokenResourceError)
        with pytest.raises(anyio.BrokenResourceError):
            worker.send_nowait(2)
        with pytest.raises(anyio.BrokenResourceError):
            await worker.send(2)
        with pytest.raises(anyio.ClosedResourceError):
            queue.receive_end.receive_nowait()
        assert queue.statistics().waiting_senders == 0

    run(loop, main)


@LOOPS
def test_a_closed_end_refuses_everything_and_withdraws_its_blocked_senders(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](1)
        queue.send_end.send_nowait(0)
        mine, other = queue.send_end.clone(), queue.send_end.clone()
        mine_out, other_out = Outcome(), Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending, mine, 1, mine_out)
            await settle()
            tg.start_soon(sending, other, 2, other_out)
            await settle()
            mine.close()
            await settle()
            assert isinstance(mine_out.error, anyio.ClosedResourceError)
            assert queue.statistics().waiting_senders == 1
            assert queue.receive_end.receive_nowait() == 0
        assert drain(queue) == [2]  # 1 was withdrawn, never delivered
        for call in (lambda: mine.send_nowait(3), mine.clone):
            with pytest.raises(anyio.ClosedResourceError):
                call()
        receive = queue.receive_end.clone()
        queue.receive_end.close()
        queue.receive_end.close()  # twice is harmless
        for closed_call in (queue.receive_end.receive_nowait, queue.receive_end.clone):
            with pytest.raises(anyio.ClosedResourceError):
                closed_call()
        other.send_nowait(4)  # a receive end is still open
        assert receive.receive_nowait() == 4

    run(loop, main)


@LOOPS
def test_a_receiver_blocked_on_an_end_that_closes_gets_closed_resource(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](1)
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiving, queue.receive_end, out)
            await settle()
            queue.receive_end.close()
        assert isinstance(out.error, anyio.ClosedResourceError)

    run(loop, main)


# -- cancellation -------------------------------------------------------------------------


@LOOPS
def test_a_cancelled_blocked_sender_does_not_deliver_and_the_next_keeps_its_place(
    loop: str,
) -> None:
    async def main() -> None:
        queue = GroupQueue[str](1)
        queue.send_end.send_nowait("x")
        first, second = Outcome(), Outcome()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(_in_scope, scope, sending, queue.send_end, "a", first)
            await settle()
            tg.start_soon(sending, queue.send_end, "b", second)
            await settle()
            scope.cancel()
            await settle()
            assert queue.statistics().waiting_senders == 1
            assert queue.receive_end.receive_nowait() == "x"
        assert isinstance(first.error, anyio.get_cancelled_exc_class())
        assert second.error is None
        assert drain(queue) == ["b"]

    run(loop, main)


@LOOPS
def test_a_sender_cancelled_as_its_item_moves_in_takes_it_back(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](1)
        queue.send_end.send_nowait("x")
        first, second = Outcome(), Outcome()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(_in_scope, scope, sending, queue.send_end, "a", first)
            await settle()
            tg.start_soon(sending, queue.send_end, "b", second)
            await settle()
            scope.cancel()  # delivered, but "a"'s sender has not run yet
            assert queue.receive_end.receive_nowait() == "x"
            assert queue.queued() == ("a",)  # moved in the same instant
            await settle()
            # Its sender raised, so "a" left again, and "b" took its place.
            assert queue.queued() == ("b",)
        assert isinstance(first.error, anyio.get_cancelled_exc_class())
        assert second.error is None
        assert drain(queue) == ["b"]

    run(loop, main)


@LOOPS
def test_a_sender_cancelled_as_its_item_is_received_reports_it_sent(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](0)
        out = Outcome()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(_in_scope, scope, sending, queue.send_end, "a", out)
            await settle()
            scope.cancel()
            assert queue.receive_end.receive_nowait() == "a"
        # Received, so sent: exactly once (the cancellation lands at its next checkpoint).
        assert out.done and out.error is None

    run(loop, main)


@LOOPS
def test_a_cancelled_receiver_loses_no_item_and_keeps_the_order(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](2)
        doomed = Outcome()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(_in_scope, scope, receiving, queue.receive_end, doomed)
            await settle()
            scope.cancel()
            queue.send_end.send_nowait("a")  # handed to the receiver being cancelled
            queue.send_end.send_nowait("b")
        assert isinstance(doomed.error, anyio.get_cancelled_exc_class())
        assert doomed.value is None
        assert drain(queue) == ["a", "b"]  # "a" came back to the front

    run(loop, main)


@LOOPS
def test_a_cancelled_receiver_hands_its_item_to_the_next_receiver(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](1)
        doomed, waiting = Outcome(), Outcome()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(_in_scope, scope, receiving, queue.receive_end, doomed)
            await settle()
            tg.start_soon(receiving, queue.receive_end, waiting)
            await settle()
            scope.cancel()
            queue.send_end.send_nowait("a")  # to the first receiver, being cancelled
        assert isinstance(doomed.error, anyio.get_cancelled_exc_class())
        assert waiting.value == "a"
        assert queue.statistics().waiting_receivers == 0

    run(loop, main)


def _me() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


async def _in_scope(scope: anyio.CancelScope, fn: Any, *args: Any) -> None:
    with scope:
        await fn(*args)


def _native_cancel_after_move(capacity: int) -> tuple[Outcome, list[str], bool]:
    """asyncio only: a cancellation from outside anyio lands after the queue moved a blocked
    sender's item (anyio's and trio's own never do)."""

    async def main() -> tuple[Outcome, list[str], bool]:
        queue = GroupQueue[str](capacity)
        if capacity:
            queue.send_end.send_nowait("x")
        out, task = Outcome(), list[asyncio.Task[Any]]()

        async def sender() -> None:
            task.append(_me())
            try:
                await queue.send_end.send("a")
            except asyncio.CancelledError as exc:
                out.error = exc
                task[0].uncancel()
            out.done = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender)
            await settle()
            first = queue.receive_end.receive_nowait()  # moves "a" (or hands it over)
            task[0].cancel()
        return out, [first, *drain(queue)], bool(task[0].cancelling())

    return anyio.run(main, backend="asyncio")


def test_a_sender_cancelled_after_its_item_moved_takes_it_back_if_still_queued() -> None:
    out, received, _ = _native_cancel_after_move(1)
    assert isinstance(out.error, asyncio.CancelledError)
    assert received == ["x"]  # "a" left the queue with its sender


def test_a_sender_cancelled_after_its_item_was_received_returns_as_sent() -> None:
    out, received, _ = _native_cancel_after_move(0)
    assert out.done and out.error is None
    assert received == ["a"]  # delivered exactly once


def test_a_receiver_cancelled_after_being_handed_an_item_gives_it_back_first() -> None:
    async def main() -> tuple[Outcome, list[str]]:
        queue = GroupQueue[str](1)
        out, task = Outcome(), list[asyncio.Task[Any]]()

        async def receiver() -> None:
            task.append(_me())
            try:
                out.value = await queue.receive_end.receive()
            except asyncio.CancelledError as exc:
                out.error = exc
                task[0].uncancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await settle()
            queue.send_end.send_nowait("a")  # handed to the receiver
            queue.send_end.send_nowait("b")
            task[0].cancel()
        return out, drain(queue)

    out, left = anyio.run(main, backend="asyncio")
    assert isinstance(out.error, asyncio.CancelledError)
    assert left == ["a", "b"]


# -- resizing -----------------------------------------------------------------------------


@LOOPS
def test_growing_lets_blocked_senders_in_in_order(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[str](1)
        queue.send_end.send_nowait("x")
        outs = [Outcome() for _ in range(3)]
        async with anyio.create_task_group() as tg:
            for item, out in zip("abc", outs, strict=True):
                tg.start_soon(sending, queue.send_end, item, out)
                await settle()
            queue.resize(3)
            await settle()
            assert queue.queued() == ("x", "a", "b")
            assert [out.done for out in outs] == [True, True, False]
            assert queue.statistics().waiting_senders == 1
            assert drain(queue) == ["x", "a", "b", "c"]

    run(loop, main)


@LOOPS
def test_shrinking_keeps_what_is_queued_and_senders_wait_below_the_new_capacity(
    loop: str,
) -> None:
    async def main() -> None:
        queue = GroupQueue[int](4)
        for i in range(4):
            queue.send_end.send_nowait(i)
        queue.resize(1)
        assert queue.queued() == (0, 1, 2, 3)
        assert queue.statistics().capacity == 1
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending, queue.send_end, 4, out)
            await settle()
            for expected in range(3):
                assert queue.receive_end.receive_nowait() == expected
                assert not out.done  # 3 is still queued, at capacity 1: 4 waits
            assert queue.receive_end.receive_nowait() == 3
            assert queue.queued() == (4,)
        assert out.error is None
        queue.resize(0)  # to a rendezvous, with a group queued: it stays
        assert drain(queue) == [4]

    run(loop, main)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", math.nan])
def test_a_bad_capacity_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        GroupQueue[int](bad)
    queue = GroupQueue[int](1)
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(")", r"\)")):
        queue.resize(bad)
    assert queue.capacity == 1


def test_an_unbounded_queue_takes_everything() -> None:
    async def main() -> None:
        queue = GroupQueue[int](math.inf)
        for i in range(1000):
            queue.send_end.send_nowait(i)
        assert queue.statistics().queued == 1000
        assert drain(queue) == list(range(1000))

    run("trio", main)


# -- statistics ---------------------------------------------------------------------------


def test_statistics_are_a_frozen_snapshot_with_anyios_names_too() -> None:
    now = [10.0]

    async def main() -> GroupQueueStatistics:
        queue = GroupQueue[str](2, clock=lambda: now[0])
        queue.send_end.send_nowait("a")
        now[0] = 12.5
        queue.send_end.send_nowait("b")
        now[0] = 14.0
        out = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending, queue.send_end.clone(), "c", out)
            await settle()
            stats = queue.statistics()
            queue.receive_end.receive_nowait()
            assert queue.statistics().oldest_age_s == 1.5  # "b" is the oldest now
            tg.cancel_scope.cancel()
        return stats

    stats = anyio.run(main, backend="asyncio")
    assert stats == GroupQueueStatistics(
        capacity=2, queued=2, waiting_senders=1, waiting_receivers=0, open_send_ends=2,
        open_receive_ends=1, oldest_age_s=4.0,
    )
    assert (
        stats.current_buffer_used, stats.max_buffer_size, stats.tasks_waiting_send,
        stats.tasks_waiting_receive, stats.open_send_streams, stats.open_receive_streams,
    ) == (2, 2, 1, 0, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.queued = 0  # type: ignore[misc]


def test_ages_run_on_the_loop_clock() -> None:
    async def main() -> list[float]:
        queue = GroupQueue[str](1)
        ages = [queue.statistics().oldest_age_s]
        queue.send_end.send_nowait("a")
        await trio.sleep(3)
        ages.append(queue.statistics().oldest_age_s)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.send_end.send, "b")  # offered at t=3, queued at t=5
            await trio.sleep(2)
            assert queue.receive_end.receive_nowait() == "a"
            ages.append(queue.statistics().oldest_age_s)
        assert queue.receive_end.statistics() == queue.send_end.statistics()
        return ages

    ages = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # A blocked sender's group is as old as its offer: it was done and waiting since then.
    assert ages == [0.0, 3.0, 2.0]


@LOOPS
def test_the_ends_are_drop_ins_for_anyios_memory_streams(loop: str) -> None:
    async def main() -> None:
        queue = GroupQueue[int](2)
        async with queue.send_end as send, queue.receive_end.clone() as receive:
            await send.send(1)
            with send.clone() as other:
                other.send_nowait(2)
            assert await receive.receive() == 1
        assert queue.statistics().open_send_ends == 0
        assert [item async for item in queue.receive_end] == [2]
        assert isinstance(queue.send_end, anyio.abc.ObjectSendStream)
        assert isinstance(queue.receive_end, anyio.abc.ObjectReceiveStream)

    run(loop, main)
