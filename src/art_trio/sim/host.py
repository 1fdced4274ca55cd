"""The trainer process's own CPU, which virtual time otherwise gets for free.

Under trio's ``MockClock`` every await of the trainer is instantaneous unless something
sleeps, so a simulated run pays nothing for starting, finishing or cancelling a rollout. A
real one does: the trainer's process (scheduler, rollout code, the bridge into asyncio) runs
on one core, and when 64 rollouts race for a batch of 8 the last one starts several
milliseconds after the first, and the 56 cancelled losers must be processed before the next
round can start. :class:`HostCPU` charges that work in virtual time: one core, served in
the order asked (FIFO). ``spend(s)`` waits until the core has done everything asked before
and then ``s`` seconds more; ``charge(s)`` books work without waiting for it (a cancelled
rollout's clean-up, which delays whoever asks next).

The charge per rollout is a measurement, not a constant of nature: ``art-trio bench`` prints
CPU per trained group, and on a zero-slack on-policy race that is (CPU per rollout) x
(rollouts started per trained group). See README.md, "the simulator's on-policy prediction".
"""

from __future__ import annotations

from art_trio.testing.doubles import Flavor, clock_for

__all__ = ["HostCPU"]


class HostCPU:
    """One core, shared by everything the simulated trainer process asks of it (FIFO)."""

    def __init__(self, *, flavor: Flavor = "anyio") -> None:
        self._sleep, self._now = clock_for(flavor)
        #: When the core has done everything booked so far.
        self._free_at = 0.0

    def charge(self, seconds: float) -> None:
        """Book `seconds` of work now, without waiting for it."""
        self._free_at = max(self._now(), self._free_at) + seconds

    async def spend(self, seconds: float) -> None:
        """Book `seconds` of work and return when the core has done it."""
        self.charge(seconds)
        await self._sleep(self._free_at - self._now())
