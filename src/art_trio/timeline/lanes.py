"""Lanes for rollouts: one per rollout running at once, so one per worker slot.

The events name no worker, but a worker runs one rollout at a time: giving each starting
rollout the lowest lane no running rollout holds (greedy interval packing) uses exactly as many
lanes as rollouts ever ran at once, and a lane is a worker slot's history.
"""

from __future__ import annotations

import heapq


class Lanes:
    """Online lane assignment: `take()` as a rollout starts, `give_back(lane)` as it ends."""

    def __init__(self) -> None:
        self._free: list[int] = []
        #: Lanes ever used (the most rollouts that ran at once).
        self.count = 0

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self.count += 1
        return self.count - 1

    def give_back(self, lane: int) -> None:
        heapq.heappush(self._free, lane)
