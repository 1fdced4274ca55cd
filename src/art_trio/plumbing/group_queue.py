"""The groups queue: completed groups on their way from the rollout workers to the trainer.

A bounded FIFO with send and receive ends that behave as anyio's memory object streams (same
methods, same exceptions: the stages were written against those), plus what art_trio needs
and anyio keeps private: `resize()`, the queued groups in order and how long the oldest has
waited. It is built on public API only (sniffio, trio's and asyncio's events and clocks,
`anyio.lowlevel.checkpoint`), so it runs unchanged on trio and on asyncio and no library
update can change it behind art_trio's back.

Semantics (the tests in tests/test_group_queue.py hold each one):

- `send` waits while the queue is full; blocked senders get in first come, first served,
  ahead of any later `send_nowait`. `receive` waits while it is empty. Capacity 0 is a
  rendezvous: a sender waits for a receiver and hands the item over directly.
- The receive end sees `EndOfStream` once every send end (clones included) is closed and
  the queue is empty. Once every receive end is closed, senders (blocked or new) get
  `BrokenResourceError`, as anyio's do. Using an end after closing it: `ClosedResourceError`.
- Exactly once: a send that raises did not deliver its item, a send that returns did, and a
  cancelled receive loses nothing. A blocked task can be cancelled in the same instant the
  queue moves its item (the cancellation was delivered, the task has not run yet): a sender
  then takes its item back out of the queue and raises, unless it was received already; then
  the send happened and returns, and the cancellation lands at the next checkpoint (its scope
  is still cancelled: trio and anyio deliver it again). A receiver hands what it was given
  back to the front of the queue (or to the next receiver) and raises.
- `resize(capacity)` lets blocked senders in when the capacity grows; when it shrinks the
  queued items stay, and senders wait until the queue is below the new capacity.

Only the queue's own methods and its ends change its state; `statistics()` is a frozen
snapshot and `queued()` a tuple, so nothing outside can reach in.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Protocol, Self, TypeVar

import anyio
import sniffio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.lowlevel import checkpoint

T = TypeVar("T")


class LoopEvent(Protocol):
    """What the queue and the gate need of an event: anyio's, trio's and asyncio's have it."""

    def set(self) -> object: ...

    async def wait(self) -> object: ...


@dataclass(frozen=True, slots=True)
class GroupQueueStatistics:
    """The queue at one instant. anyio's `MemoryObjectStreamStatistics` names are properties
    here too, so code written against a memory object stream reads it unchanged."""

    #: How many items the queue holds before a sender waits (`math.inf`: unbounded).
    capacity: float
    #: Items in the queue now (not counting those of blocked senders).
    queued: int
    #: Tasks blocked in `send` (their items are not in `queued`).
    waiting_senders: int
    #: Tasks blocked in `receive`.
    waiting_receivers: int
    open_send_ends: int
    open_receive_ends: int
    #: Seconds on the loop clock since the oldest queued item was offered; 0.0 when empty.
    oldest_age_s: float

    @property
    def current_buffer_used(self) -> int:
        return self.queued

    @property
    def max_buffer_size(self) -> float:
        return self.capacity

    @property
    def tasks_waiting_send(self) -> int:
        return self.waiting_senders

    @property
    def tasks_waiting_receive(self) -> int:
        return self.waiting_receivers

    @property
    def open_send_streams(self) -> int:
        return self.open_send_ends

    @property
    def open_receive_streams(self) -> int:
        return self.open_receive_ends


# A blocked sender's state, as the queue last left it.
_WAITING, _MOVED, _BROKEN, _WITHDRAWN = range(4)


class _Sender(Generic[T]):
    """A task blocked in `send`: its item, and what became of it."""

    __slots__ = ("at", "event", "item", "state")

    def __init__(self, item: T, at: float, event: LoopEvent) -> None:
        self.event = event
        self.item = item
        self.at = at  # when it was offered: its age counts from here once it is queued
        self.state = _WAITING


class _Receiver(Generic[T]):
    """A task blocked in `receive`; `entry` is what a sender handed it."""

    __slots__ = ("entry", "event")

    def __init__(self, event: LoopEvent) -> None:
        self.event = event
        self.entry: tuple[T, float, _Sender[T] | None] | None = None


def loop_primitives() -> tuple[Callable[[], float], Callable[[], LoopEvent]]:
    """The running loop's clock and event class: the native ones (anyio's wrappers cost a
    backend lookup per call, and the queue and the stages read the time several times per
    rollout; trio's clock object itself, virtual under MockClock, skips
    `trio.current_time`'s run lookup)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_clock().current_time, trio.Event
    return asyncio.get_running_loop().time, asyncio.Event


def _check_capacity(capacity: float) -> float:
    if isinstance(capacity, bool) or not (
        (isinstance(capacity, int) and capacity >= 0) or capacity == math.inf
    ):
        raise ValueError(
            f"the groups queue's capacity must be an int >= 0 or math.inf, not {capacity!r}"
        )
    return capacity


class GroupQueue(Generic[T]):
    """A bounded FIFO of items (groups) with clonable send ends and receive ends.

    `queue.send_end` and `queue.receive_end` are its first two ends (clone them for more).
    The queue holds all the state; the ends hold only whether they are closed and the tasks
    blocked on them.
    """

    def __init__(self, capacity: float, *, clock: Callable[[], float] | None = None) -> None:
        self._capacity = _check_capacity(capacity)
        #: Queued items in order: (item, when offered, the blocked sender it came from).
        self._buffer: deque[tuple[T, float, _Sender[T] | None]] = deque()
        self._senders: OrderedDict[_Sender[T], None] = OrderedDict()
        self._receivers: OrderedDict[_Receiver[T], None] = OrderedDict()
        self._open_send = 0
        self._open_receive = 0
        #: The loop's clock and event class, found on first use (the queue may be built
        #: before the loop runs); `clock` replaces the loop's clock (tests).
        self._now: Callable[[], float] = clock or self._first_now
        self._event: Callable[[], LoopEvent] = self._first_event
        self.send_end: GroupSendEnd[T] = GroupSendEnd(self)
        self.receive_end: GroupReceiveEnd[T] = GroupReceiveEnd(self)

    # -- what anyone may read or change --------------------------------------------------

    @property
    def capacity(self) -> float:
        return self._capacity

    def resize(self, capacity: float) -> None:
        """Hold up to `capacity` items from now on: if it grew, blocked senders get in (in
        order); if it shrank below what is queued, nothing is dropped and senders wait until
        the queue is below it."""
        self._capacity = _check_capacity(capacity)
        self._admit()

    def statistics(self) -> GroupQueueStatistics:
        buffer = self._buffer
        return GroupQueueStatistics(
            capacity=self._capacity,
            queued=len(buffer),
            waiting_senders=len(self._senders),
            waiting_receivers=len(self._receivers),
            open_send_ends=self._open_send,
            open_receive_ends=self._open_receive,
            # The head is the oldest: items enter in the order they were offered.
            oldest_age_s=self._now() - buffer[0][1] if buffer else 0.0,
        )

    def queued(self) -> tuple[T, ...]:
        """The queued items, first to be received first (blocked senders' not included)."""
        return tuple(entry[0] for entry in self._buffer)

    # -- the ends' operations ------------------------------------------------------------

    def _first_now(self) -> float:
        self._now = loop_primitives()[0]
        return self._now()

    def _first_event(self) -> LoopEvent:
        self._event = loop_primitives()[1]
        return self._event()

    def _admit(self) -> None:
        """Blocked senders' items into the queue, in order, while there is room."""
        buffer, senders = self._buffer, self._senders
        while senders and len(buffer) < self._capacity:
            sender, _ = senders.popitem(last=False)
            buffer.append((sender.item, sender.at, sender))
            sender.state = _MOVED
            sender.event.set()

    def _take_back(self, sender: _Sender[T]) -> bool:
        """A moved sender's item out of the queue again, if no one received it yet."""
        for index, entry in enumerate(self._buffer):
            if entry[2] is sender:
                del self._buffer[index]
                self._admit()
                return True
        return False

    def _give_back(self, entry: tuple[T, float, _Sender[T] | None]) -> None:
        """An item a cancelled receiver was handed: to the next receiver, or to the front
        of the queue (it was the oldest; the queue may hold one more than its capacity)."""
        if self._receivers:
            receiver, _ = self._receivers.popitem(last=False)
            receiver.entry = entry
            receiver.event.set()
        else:
            self._buffer.appendleft(entry)

    def _no_receivers_left(self) -> None:
        for sender in self._senders:
            sender.state = _BROKEN
            sender.event.set()
        self._senders.clear()

    def _no_senders_left(self) -> None:
        for receiver in self._receivers:
            receiver.event.set()  # nothing handed: EndOfStream
        self._receivers.clear()


class _End(Generic[T]):
    """What both ends share: closing (sync, async, as a context manager) and the queue's
    statistics. Each end supplies `close()` and `queue`."""

    queue: GroupQueue[T]

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.close()

    def statistics(self) -> GroupQueueStatistics:
        return self.queue.statistics()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.close()


class GroupSendEnd(_End[T], ObjectSendStream[T]):
    """A send end: `send`, `send_nowait`, `clone`, `close`, as anyio's memory send stream."""

    def __init__(self, queue: GroupQueue[T]) -> None:
        self.queue = queue
        self._closed = False
        #: This end's blocked senders (closing the end withdraws them).
        self._blocked: set[_Sender[T]] = set()
        queue._open_send += 1

    def send_nowait(self, item: T) -> None:
        """Queue `item` now; `anyio.WouldBlock` if the queue is full."""
        # The queue's hot path, once per group: written out here rather than delegated.
        if self._closed:
            raise anyio.ClosedResourceError
        queue = self.queue
        if not queue._open_receive:
            raise anyio.BrokenResourceError
        if queue._receivers:
            receiver, _ = queue._receivers.popitem(last=False)
            receiver.entry = (item, queue._now(), None)
            receiver.event.set()
        elif len(queue._buffer) < queue._capacity:
            queue._buffer.append((item, queue._now(), None))
        else:
            raise anyio.WouldBlock

    async def send(self, item: T) -> None:
        """Queue `item`, waiting while the queue is full."""
        await checkpoint()
        try:
            self.send_nowait(item)
            return
        except anyio.WouldBlock:
            pass
        queue = self.queue
        sender = _Sender(item, queue._now(), queue._event())
        queue._senders[sender] = None
        self._blocked.add(sender)
        try:
            await sender.event.wait()
        except BaseException as exc:
            if sender.state == _WAITING:
                del queue._senders[sender]
                raise
            if sender.state != _MOVED or queue._take_back(sender):
                raise
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            # Received already: the send happened. The cancellation lands at the next
            # checkpoint (the scope is still cancelled), as with trio's channels.
            return
        finally:
            self._blocked.discard(sender)
        if sender.state == _BROKEN:
            raise anyio.BrokenResourceError
        if sender.state == _WITHDRAWN:
            raise anyio.ClosedResourceError

    def clone(self) -> GroupSendEnd[T]:
        """Another send end of the same queue; receivers see the end of the stream once
        every send end is closed."""
        if self._closed:
            raise anyio.ClosedResourceError
        return GroupSendEnd(self.queue)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        queue = self.queue
        for sender in self._blocked:
            if sender.state == _WAITING:
                del queue._senders[sender]
                sender.state = _WITHDRAWN
                sender.event.set()
        queue._open_send -= 1
        if not queue._open_send:
            queue._no_senders_left()


class GroupReceiveEnd(_End[T], ObjectReceiveStream[T]):
    """A receive end: `receive`, `receive_nowait`, `clone`, `close`, `async for`, as
    anyio's memory receive stream."""

    def __init__(self, queue: GroupQueue[T]) -> None:
        self.queue = queue
        self._closed = False
        self._blocked: set[_Receiver[T]] = set()
        queue._open_receive += 1

    def receive_nowait(self) -> T:
        """The next item now; `anyio.WouldBlock` if none is there, `anyio.EndOfStream` if
        none will come."""
        if self._closed:
            raise anyio.ClosedResourceError
        queue = self.queue
        if queue._buffer:
            item = queue._buffer.popleft()[0]
            if queue._senders:
                queue._admit()
            return item
        if queue._senders:
            # Capacity 0 (or shrunk to it): the first sender hands its item over directly.
            sender, _ = queue._senders.popitem(last=False)
            sender.state = _MOVED
            sender.event.set()
            return sender.item
        if not queue._open_send:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> T:
        """The next item, waiting while the queue is empty."""
        await checkpoint()
        try:
            return self.receive_nowait()
        except anyio.WouldBlock:
            pass
        queue = self.queue
        receiver: _Receiver[T] = _Receiver(queue._event())
        queue._receivers[receiver] = None
        self._blocked.add(receiver)
        try:
            await receiver.event.wait()
        except BaseException:
            queue._receivers.pop(receiver, None)
            if receiver.entry is not None:
                queue._give_back(receiver.entry)
            raise
        finally:
            self._blocked.discard(receiver)
        if receiver.entry is not None:
            return receiver.entry[0]
        if self._closed:
            raise anyio.ClosedResourceError
        raise anyio.EndOfStream

    def clone(self) -> GroupReceiveEnd[T]:
        if self._closed:
            raise anyio.ClosedResourceError
        return GroupReceiveEnd(self.queue)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        queue = self.queue
        for receiver in self._blocked:
            if receiver.entry is None:
                queue._receivers.pop(receiver, None)
                receiver.event.set()  # nothing handed, end closed: ClosedResourceError
        queue._open_receive -= 1
        if not queue._open_receive:
            queue._no_receivers_left()
