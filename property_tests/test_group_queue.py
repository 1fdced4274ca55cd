"""The groups queue against a plain model, on trio and on asyncio.

Random programs of sends and receives (blocking and not, on two send ends), resizes,
cancellations of blocked tasks and closes run on a real `GroupQueue`; after each step every
task is left to settle (`anyio.wait_all_tasks_blocked()`) and the queue must match a list-
based model exactly: what is queued and in which order, who is blocked, and how every
finished send or receive ended. Over the whole program: no item is lost, duplicated or
reordered, and an item enters the queue only while it is below capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from art_trio.plumbing.group_queue import GroupQueue

# The outcomes a send or a receive can end with ("pending" while blocked).
SENT, CANCELLED, BROKEN, CLOSED, EOS, WOULD_BLOCK = (
    "sent", "cancelled", "broken", "closed", "end of stream", "would block"
)

Op = tuple[Any, ...]

#: How often each step is drawn: mostly traffic, as closes end most of what is interesting.
WEIGHTS = {
    "send": 6, "send_nowait": 3, "receive": 6, "receive_nowait": 3, "resize": 2,
    "cancel_sender": 2, "cancel_receiver": 2, "close_send": 1, "close_receive": 1,
}
ARGUMENTS = {
    "send": st.integers(0, 1), "send_nowait": st.integers(0, 1), "resize": st.integers(0, 4),
    "cancel_sender": st.integers(0, 7), "cancel_receiver": st.integers(0, 7),
    "close_send": st.integers(0, 1),
}
ops = st.sampled_from([name for name, weight in WEIGHTS.items() for _ in range(weight)]).flatmap(
    lambda name: st.tuples(st.just(name), ARGUMENTS[name]) if name in ARGUMENTS
    else st.just((name,))
)


@dataclass
class Model:
    """The queue's meaning, with nothing concurrent about it."""

    capacity: int
    buffer: list[int] = field(default_factory=list)
    senders: list[tuple[int, int, int]] = field(default_factory=list)  # (task, item, end)
    receivers: list[int] = field(default_factory=list)
    open_ends: set[int] = field(default_factory=lambda: {0, 1})
    receive_open: bool = True
    outcomes: dict[int, Any] = field(default_factory=dict)
    #: Items in the order they entered the queue or were handed to a receiver.
    accepted: list[int] = field(default_factory=list)
    #: The queue's length whenever an item entered it (must be below the capacity then).
    entered_at: list[tuple[int, int]] = field(default_factory=list)

    def _enter(self, item: int) -> None:
        self.entered_at.append((len(self.buffer), self.capacity))
        self.buffer.append(item)
        self.accepted.append(item)

    def _admit(self) -> None:
        while self.senders and len(self.buffer) < self.capacity:
            task, item, _ = self.senders.pop(0)
            self._enter(item)
            self.outcomes[task] = SENT

    def send(self, task: int, item: int, end: int, wait: bool) -> None:
        if end not in self.open_ends:
            self.outcomes[task] = CLOSED
        elif not self.receive_open:
            self.outcomes[task] = BROKEN
        elif self.receivers:
            self.accepted.append(item)
            self.outcomes[self.receivers.pop(0)] = ("received", item)
            self.outcomes[task] = SENT
        elif len(self.buffer) < self.capacity:
            self._enter(item)
            self.outcomes[task] = SENT
        elif wait:
            self.senders.append((task, item, end))
        else:
            self.outcomes[task] = WOULD_BLOCK

    def receive(self, task: int, wait: bool) -> None:
        if not self.receive_open:
            self.outcomes[task] = CLOSED
        elif self.buffer:
            self.outcomes[task] = ("received", self.buffer.pop(0))
            self._admit()
        elif self.senders:  # capacity 0: straight from the first sender
            sender, item, _ = self.senders.pop(0)
            self.accepted.append(item)
            self.outcomes[sender] = SENT
            self.outcomes[task] = ("received", item)
        elif not self.open_ends:
            self.outcomes[task] = EOS
        elif wait:
            self.receivers.append(task)
        else:
            self.outcomes[task] = WOULD_BLOCK

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._admit()

    def cancel_sender(self, k: int) -> int | None:
        if not self.senders:
            return None
        task, _, _ = self.senders.pop(k % len(self.senders))
        self.outcomes[task] = CANCELLED
        return task

    def cancel_receiver(self, k: int) -> int | None:
        if not self.receivers:
            return None
        task = self.receivers.pop(k % len(self.receivers))
        self.outcomes[task] = CANCELLED
        return task

    def close_send(self, end: int) -> None:
        if end not in self.open_ends:
            return
        self.open_ends.discard(end)
        for task, _, _ in [s for s in self.senders if s[2] == end]:
            self.outcomes[task] = CLOSED
        self.senders = [s for s in self.senders if s[2] != end]
        if not self.open_ends:
            for task in self.receivers:
                self.outcomes[task] = EOS
            self.receivers = []

    def close_receive(self) -> None:
        if not self.receive_open:
            return
        self.receive_open = False
        for task, _, _ in self.senders:
            self.outcomes[task] = BROKEN
        for task in self.receivers:  # blocked on the end that closed
            self.outcomes[task] = CLOSED
        self.senders, self.receivers = [], []


def _outcome_of(exc: BaseException | None, value: Any) -> Any:
    if exc is None:
        return ("received", value) if value is not None else SENT
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return CANCELLED
    return {
        anyio.BrokenResourceError: BROKEN,
        anyio.ClosedResourceError: CLOSED,
        anyio.EndOfStream: EOS,
        anyio.WouldBlock: WOULD_BLOCK,
    }[type(exc)]


async def _play(capacity: int, program: list[Op]) -> Model:
    queue = GroupQueue[int](capacity)
    ends = [queue.send_end, queue.send_end.clone()]
    receive = queue.receive_end
    model = Model(capacity)
    outcomes: dict[int, Any] = {}
    scopes: dict[int, anyio.CancelScope] = {}
    next_item = iter(range(10**6))

    async def task(number: int, call: Any) -> None:
        with scopes[number]:
            try:
                value = await call()
            except BaseException as exc:
                outcomes[number] = _outcome_of(exc, None)
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
            else:
                outcomes[number] = _outcome_of(None, value)

    def now(number: int, call: Any) -> None:
        try:
            value = call()
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError,
                anyio.EndOfStream) as exc:
            outcomes[number] = _outcome_of(exc, None)
        else:
            outcomes[number] = _outcome_of(None, value)

    async with anyio.create_task_group() as tg:
        for number, (name, *args) in enumerate(program):
            scopes[number] = anyio.CancelScope()
            if name in ("send", "send_nowait"):
                item, end = next(next_item), ends[args[0]]
                model.send(number, item, args[0], wait=name == "send")
                if name == "send":
                    tg.start_soon(task, number, lambda e=end, i=item: e.send(i))
                else:
                    now(number, lambda e=end, i=item: e.send_nowait(i))
            elif name == "receive":
                model.receive(number, wait=True)
                tg.start_soon(task, number, receive.receive)
            elif name == "receive_nowait":
                model.receive(number, wait=False)
                now(number, receive.receive_nowait)
            elif name == "resize":
                model.resize(args[0])
                queue.resize(args[0])
            elif name in ("cancel_sender", "cancel_receiver"):
                cancelled = getattr(model, name)(args[0])
                if cancelled is not None:
                    scopes[cancelled].cancel()
            elif name == "close_send":
                model.close_send(args[0])
                ends[args[0]].close()
            else:
                model.close_receive()
                receive.close()
            await anyio.wait_all_tasks_blocked()
            stats = queue.statistics()
            assert list(queue.queued()) == model.buffer, (number, name)
            assert stats.capacity == model.capacity
            assert stats.waiting_senders == len(model.senders)
            assert stats.waiting_receivers == len(model.receivers)
            assert outcomes == model.outcomes, (number, name)
        tg.cancel_scope.cancel()  # what is still blocked
    return model


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
@given(capacity=st.integers(0, 2), program=st.lists(ops, min_size=8, max_size=48))
def test_the_queue_behaves_as_its_model(loop: str, capacity: int, program: list[Op]) -> None:
    model = anyio.run(_play, capacity, program, backend=loop)
    received = [o[1] for o in model.outcomes.values() if isinstance(o, tuple)]
    # Nothing duplicated or reordered: received in the order accepted, each once.
    assert received == model.accepted[: len(received)]
    assert len(set(received)) == len(received)
    # Nothing lost: every accepted item was received or is still queued.
    assert model.accepted == received + model.buffer
    # Capacity respected: an item entered only while the queue was below its capacity.
    assert all(length < capacity for length, capacity in model.entered_at)
