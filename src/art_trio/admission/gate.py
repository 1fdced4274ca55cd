"""`MeasuringGate`: the kernel's gate, measuring what staleness-aware admission decides from.

Besides the kernel's counts and mean latency it keeps: the load model (rollout latency filed
under the mean number in flight while each ran: a shared server's queueing, see snapshot.py),
cohorts (rollouts that started together and how much later than their cohort's median each
ended), the Kaplan-Meier slow tail of latency (`latency_tail`), the share of groups the trainer
finds trainable (`trainable_share`), and, where a race cancels most rollouts so that the tail
cannot be read, one doomed racer per batch let run to its end, whose lateness stands in for it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Collection, Iterable
from typing import Any

import anyio

from ..policy.gate import LATENCY_DECAY, PolicyGate
from .snapshot import (
    MIN_LOAD_COMPLETIONS,
    RACE_SPREAD,
    MeasuredSnapshot,
    latency_grows_with_load,
    latency_tail,
)

#: Recent rollouts whose start times the gate keeps, to find the ones that started together
#: (`cohort_lateness`), and how close two starts must be, as a share of the shorter rollout's
#: time, for the two to count as started together.
RECENT_RUNS = 64
COHORT_GAP = 0.02
#: Doomed rollouts let run on whose times stand in for the slow tail of latency where races
#: cancel most rollouts (`latency_tail` cannot tell): the last this many that ended.
MIN_SPARED = 4
#: Changes of the in-flight count the gate remembers, to average a rollout's load over its
#: life (a rollout that started before the oldest is averaged from there).
LOAD_MARKS = 4096


def _look_alike(completed: list[float]) -> bool:
    """The sorted completed times' slow decile is within `RACE_SPREAD` of their median: what a
    race's winners show whatever the latencies, so a reason to measure, never to narrow."""
    n = len(completed)
    return n >= 2 * MIN_SPARED and completed[int(0.9 * (n - 1))] <= RACE_SPREAD * completed[
        (n - 1) // 2
    ]


def cohort_lateness(runs: Iterable[tuple[float, float, bool]]) -> tuple[float, ...]:
    """How much later than the median of its cohort each rollout ended, sorted.

    `runs` are rollouts' (start, seconds run, completed). A cohort is the rollouts that
    started together (a publish, or a race, admitting several at once: starts apart by at
    most `COHORT_GAP` of the shorter one's time); one that started alone has no cohort and is
    left out. A rollout cancelled before it ended did not end with its cohort: it is
    infinitely late (at `max_steps_off_policy == 0` the losers of a race, whose winners alone
    would look as if they ended together).
    """
    late: list[float] = []
    cohort: list[float] = []
    first_start, first_seconds = -math.inf, 0.0
    for start, seconds, completed in sorted(runs):
        if start - first_start > COHORT_GAP * min(seconds, first_seconds):
            _add_lateness(cohort, late)
            cohort, first_start, first_seconds = [], start, seconds
        cohort.append(seconds if completed else math.inf)
    _add_lateness(cohort, late)
    return tuple(sorted(late))


def _add_lateness(cohort: list[float], late: list[float]) -> None:
    if len(cohort) > 1:
        cohort.sort()
        median = cohort[(len(cohort) - 1) // 2]
        if math.isinf(median):  # most were cancelled: none ended with the cohort
            late.extend([math.inf] * len(cohort))
        else:
            late.extend(seconds - median for seconds in cohort)


class MeasuringGate(PolicyGate):
    """The kernel's `PolicyGate`, whose snapshots carry the load model, cohorts and the slow
    tail of latency (`MeasuredSnapshot`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Doomed rollouts let run on to measure the slow tail (see `_cancel_doomed`): when
        # each started and when it was doomed; and how long the ended ones ran over the time
        # they had run when doomed.
        self._spared: dict[anyio.CancelScope, tuple[float, float]] = {}
        self._spared_lateness: deque[float] = deque(maxlen=MIN_SPARED)
        self._latency_tail: float | None = None
        self._spare_a_loser = False
        self._recent_runs: deque[tuple[float, float, bool]] = deque(maxlen=RECENT_RUNS)
        self._cohort_lateness: tuple[float, ...] = ()
        # The load model (see snapshot.py): rollouts in flight over time, as the running
        # integral of the count at each change, and latency sums per mean count.
        self._load_area = 0.0
        self._load_at: float | None = None
        self._mark_times: list[float] = []
        self._mark_areas: list[float] = []
        self._by_load: dict[int, list[float]] = {}  # count -> [time, completions, sample no.]
        self._load_samples = 0
        self._load_latency: tuple[tuple[int, float, float], ...] = ()
        self._queueing = False
        # Groups judged trainable, of all judged (decayed per group), counting one trainable
        # group before any is judged: the share is 1.0 exactly while none scores alike.
        self._trainable = 1.0
        self._judged = 1.0

    def snapshot(self) -> MeasuredSnapshot:
        return MeasuredSnapshot(
            *self._snapshot_fields(),
            load_latency=self._load_latency,
            cohort_lateness=self._cohort_lateness,
            latency_tail=self._latency_tail,
            trainable_share=self._trainable / self._judged,
        )

    @property
    def spared(self) -> Collection[anyio.CancelScope]:
        """Scopes of doomed rollouts left running to measure the slow tail of latency."""
        return self._spared.keys()

    # -- the kernel gate's hooks -----------------------------------------------------------

    def _rollout_measured(
        self, seconds: float, completed: bool, done: list[float] | None,
        cancelled: list[float] | None,
    ) -> None:
        now = self._clock()
        self._recent_runs.append((now - seconds, seconds, completed))
        self._note_load(seconds, completed, now, refresh=done is not None)
        if done is None or cancelled is None:
            return
        tail = latency_tail(done, cancelled)
        self._spare_a_loser = tail is None and _look_alike(done)
        if tail is None and len(self._spared_lateness) == MIN_SPARED:
            tail = sorted(self._spared_lateness)[int(0.9 * (MIN_SPARED - 1))]
        self._latency_tail = tail
        self._cohort_lateness = cohort_lateness(self._recent_runs)

    def _load_changing(self) -> None:
        self._mark_load(self._clock())

    def _headroom(self) -> float:
        s = self.snapshot()
        headroom = self._policy.headroom(s)
        if self._queueing:
            # A group handed over leaves the shared server (load - 1) for the queue, which no
            # window rule counts in its favour: it can let a waiter in only where the load
            # cap held this decision. Elsewhere a decision per hand-over admits nothing and
            # costs the scheduler a tenth of its time per group.
            cap = s.load_cap
            self._hand_over_frees = cap is not None and headroom >= cap - s.load
        return headroom

    def _groups_judged(self, trainable: int, scored_alike: int) -> None:
        # The same operations on both sums while none scores alike keep their ratio 1.0.
        decay = LATENCY_DECAY ** (trainable + scored_alike)
        self._trainable = self._trainable * decay + trainable
        self._judged = self._judged * decay + (trainable + scored_alike)

    def _cancel_doomed(self, doomed: list[dict[anyio.CancelScope, float]], now: float) -> None:
        # Where the completed rollouts look alike but the slow tail of latency is not
        # measured (most were cancelled: a race's winners), one doomed rollout runs on to
        # its end. Cancelled rollouts only say they would have taken longer; these show
        # whether the rest would have ended with the winners (`latency_tail`).
        spare = self._spare_a_loser
        for scopes in doomed:
            for scope, started in scopes.items():
                if spare and started < now:
                    spare = False
                    self._spared[scope] = (started, now)
                else:
                    scope.cancel()

    def untrack(self, version: int, scope: anyio.CancelScope) -> None:
        spared = self._spared.pop(scope, None)
        if spared is not None and not scope.cancel_called:
            started, doomed = spared
            self._spared_lateness.append((self._clock() - started) / (doomed - started))
        super().untrack(version, scope)

    # -- the load model ----------------------------------------------------------------------

    def _note_load(self, seconds: float, completed: bool, now: float, *, refresh: bool) -> None:
        """File a rollout that ran `seconds` until `now` under the mean in-flight count."""
        self._mark_load(now)
        start = now - seconds
        if seconds > 0 and self._mark_times:
            i = bisect.bisect_right(self._mark_times, start) - 1
            if i < 0:
                # Started before the oldest mark: average from the oldest.
                i, start = 0, self._mark_times[0]
            # The count is constant between marks: the area up to `start` is linear there.
            area_then = self._mark_areas[i] + self._count_after(i) * (start - self._mark_times[i])
            span = now - start
            mean = (self._load_area - area_then) / span if span > 0 else self._load
        else:
            mean = self._load
        count = max(1, round(mean))
        self._load_samples += 1
        entry = self._by_load.get(count)
        if entry is None:
            entry = self._by_load[count] = [0.0, 0.0, self._load_samples]
        decay = LATENCY_DECAY ** (self._load_samples - entry[2])
        entry[0] = entry[0] * decay + seconds
        entry[1] = entry[1] * decay + completed
        entry[2] = self._load_samples
        if refresh:
            self._load_latency = self._load_model()
            self._queueing = latency_grows_with_load(self._load_latency)
            # At a shared server a group handed over frees a slot there: decide again (until
            # a decision shows the load cap is not what holds the waiters, `_headroom`).
            self._hand_over_frees = self._queueing

    def _count_after(self, i: int) -> float:
        """The in-flight count between mark `i` and the next (from their areas)."""
        if i + 1 < len(self._mark_times):
            width = self._mark_times[i + 1] - self._mark_times[i]
            if width > 0:
                return (self._mark_areas[i + 1] - self._mark_areas[i]) / width
            return 0.0
        return self._load

    def _load_model(self) -> tuple[tuple[int, float, float], ...]:
        model = []
        for count, (total, completions, sample) in sorted(self._by_load.items()):
            decay = LATENCY_DECAY ** (self._load_samples - sample)
            if completions * decay >= MIN_LOAD_COMPLETIONS:
                model.append((count, total / completions, completions * decay))
        return tuple(model)

    def _mark_load(self, now: float) -> None:
        """Bring the in-flight integral up to `now` (before the count changes)."""
        if self._load_at is not None:
            self._load_area += self._load * (now - self._load_at)
        self._load_at = now
        self._mark_times.append(now)
        self._mark_areas.append(self._load_area)
        if len(self._mark_times) > 2 * LOAD_MARKS:
            del self._mark_times[:LOAD_MARKS]
            del self._mark_areas[:LOAD_MARKS]
