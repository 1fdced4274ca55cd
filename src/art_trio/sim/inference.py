"""How an inference server turns a rollout's latency draw into the time it really takes.

A workload's latency distribution gives each rollout its *uncontended* latency: the time it
takes when the server has room for it. Two effects are modelled on top, both optional:

- **Contention** (:class:`ProcessorSharing`): an inference server with ``capacity`` C serves
  up to C requests at full speed (a continuous-batching server such as vLLM up to its batch
  limit); beyond that, its throughput is saturated and the n requests in flight share it
  equally, each progressing at C / n of full speed. This is the processor-sharing queue with
  C servers (egalitarian PS with rate ``min(1, C / n)`` per request). A rollout whose draw is
  ``w`` seconds finishes once it has received ``w`` seconds of service; while n <= C that is
  ``w`` seconds, and with n > C in flight throughout it is ``w * n / C``. Every arrival and
  departure changes the rate of all requests in flight, so a rollout's latency depends on
  what else runs during it, not just at its start. Cancelled requests leave at once and free
  their share.
- **A latency shift** (:class:`LatencyShift`): rollouts *started* once a number of train steps
  have finished take ``factor`` times their draw (e.g. 2: the rollouts' latency doubles
  halfway through a run, as when a policy learns to write longer answers).

The server is exact in virtual time (trio's ``MockClock``) and costs O(log n) per arrival or
departure: only the request that will finish first waits on a timer; the others wait to
become first. Service is tracked with the PS "virtual time" V, the service each request in
flight has received since V = 0: dV/dt = min(1, C / n); a request arriving at V_a with work w
finishes when V reaches V_a + w, so requests finish in the order of those tags.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from art_trio.testing.doubles import Flavor, clock_for

__all__ = ["LatencyShift", "ProcessorSharing"]


@dataclass(frozen=True)
class LatencyShift:
    """Rollouts started after ``after_steps`` finished train steps take ``factor`` x their draw."""

    after_steps: int
    factor: float

    def __post_init__(self) -> None:
        if self.after_steps < 0 or self.factor <= 0:
            raise ValueError("a latency shift needs after_steps >= 0 and factor > 0")

    def scale(self, steps_done: int) -> float:
        """The factor for a rollout starting when ``steps_done`` train steps have finished."""
        return self.factor if steps_done >= self.after_steps else 1.0

    def describe(self) -> str:
        return f"latency x{self.factor:g} after step {self.after_steps}"


@dataclass(order=True)
class _Request:
    tag: float
    seq: int
    #: Set when the request becomes the first to finish (re-made each time it waits).
    promoted: Any = field(compare=False, default=None)


class ProcessorSharing:
    """An inference server of ``capacity`` concurrent requests, shared beyond that (see module).

    ``await server.serve(work)`` returns when a request needing ``work`` seconds of
    uncontended service has received it. ``in_flight`` is the number of requests being
    served; ``max_in_flight`` the most at once. Use one server per event loop run, from tasks
    of the flavor it was made for (anyio, or asyncio code under the trio-asyncio bridge).
    """

    #: Relative slack under which a request counts as fully served (float rounding).
    _EPS = 1e-9

    def __init__(self, capacity: int, *, flavor: Flavor = "anyio") -> None:
        if capacity <= 0:
            raise ValueError("inference capacity must be > 0")
        self.capacity = capacity
        self.flavor: Flavor = flavor
        _, self._now = clock_for(flavor)
        self._event: Callable[[], Any] = asyncio.Event if flavor == "asyncio" else anyio.Event
        self.in_flight = 0
        self.max_in_flight = 0
        self._served = 0.0  # V: service per request in flight, since the start
        self._at: float | None = None  # when V was last brought up to date
        self._queue: list[_Request] = []  # heap by finish tag
        self._seq = itertools.count()
        # Set (and replaced) on every arrival and departure; made on first use, in the loop.
        self._changed: Any = None

    def rate(self) -> float:
        """Seconds of service per second each request in flight receives now."""
        n = self.in_flight
        return 1.0 if n <= self.capacity else self.capacity / n

    def _advance(self) -> None:
        now = self._now()
        if self._at is not None:
            self._served += (now - self._at) * self.rate()
        self._at = now

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = self._event()

    async def _wait(self, event: Any, seconds: float) -> None:
        """Until ``event`` is set or ``seconds`` have passed."""
        if self.flavor == "asyncio":
            try:
                await asyncio.wait_for(event.wait(), seconds)
            except TimeoutError:
                pass
        else:
            with anyio.move_on_after(seconds):
                await event.wait()

    async def serve(self, work: float) -> None:
        """Wait until a request of ``work`` seconds of uncontended service has been served."""
        self._advance()
        request = _Request(tag=self._served + max(0.0, work), seq=next(self._seq))
        heapq.heappush(self._queue, request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._notify()  # the first request's rate just changed
        try:
            await self._until_served(request)
        finally:
            self._leave(request)

    async def _until_served(self, request: _Request) -> None:
        while True:
            if self._queue[0] is not request:
                # Not the first to finish: wait until the one ahead leaves (or is overtaken).
                request.promoted = self._event()
                await request.promoted.wait()
                continue
            self._advance()
            remaining = request.tag - self._served
            if remaining <= self._EPS * max(1.0, request.tag):
                return
            await self._wait(self._changed, remaining / self.rate())

    def _leave(self, request: _Request) -> None:
        self._advance()
        was_first = self._queue[0] is request
        self._queue.remove(request)
        heapq.heapify(self._queue)
        self.in_flight -= 1
        self._notify()  # the rate of everyone left just changed
        if was_first and self._queue and self._queue[0].promoted is not None:
            self._queue[0].promoted.set()
