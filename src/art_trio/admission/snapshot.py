"""`MeasuredSnapshot`: the kernel's `GateSnapshot` with what the measuring gate adds, and the
estimates staleness-aware admission reads from it (Little's-law pipeline target, the measured
straggler spread and on-time probability, whether racers end together, and the shared
server's load model).

**Queueing at a shared server.** Where rollouts share one inference server that batches them
(vLLM, art_trio's CPU server), a rollout's latency grows with the number in flight: past the
server's capacity its throughput is saturated and the rollouts in flight share it. Latency
measured at today's load says nothing about the load one more admission makes. The gate
therefore measures mean latency per in-flight count (`load_latency`), and the snapshot reads
from it the server's throughput X (rollouts per second: the most any measured load achieved,
n / latency(n)) and its uncontended latency L0 (the latency at the lowest load measured). With
n in flight a rollout then takes about max(L0, n / X) (the processor-sharing queue; an
extrapolation past the loads measured that assumes the server saturated, so it errs towards
fewer admissions). A rollout admitted now can finish inside its freshness window W only while
the rollouts in flight, itself included, are at most X * W (`load_cap`): admitting one more
slows every rollout in flight, which this cap accounts for. The model applies only where it
was seen: latency measured at loads apart (`MIN_LOAD_SPREAD`) and rising with load at least
half as fast as a saturated server's (`MIN_QUEUEING_SHARE`); rollouts whose latency does not
depend on the load (their own environments, a server far from its capacity) are never capped.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..messages.values import cheap_init
from ..policy.gate_snapshot import GateSnapshot

#: The rollout-time quantile that counts as "slow" in `rollout_spread`.
STRAGGLER_QUANTILE = 0.98
#: Recent rollout times a snapshot needs before it trusts them over the exponential model.
MIN_TIME_SAMPLES = 32
#: Completed rollout times `latency_tail` needs, and how far past the median the slow decile
#: may end for rollouts to count as ending together.
MIN_RACE_SAMPLES = 16
RACE_SPREAD = 1.5
#: Completions `latency_tail` needs at or past the median: the slow tail is then measured, not
#: read from the few rollouts that happened to outlast a race's cancellation.
MIN_TAIL_SAMPLES = 8
#: ... or, for rollouts that started together, how far past their cohort's median the slow
#: decile may end, as a share of the step period.
COHORT_LATE_SHARE = 0.25
#: Floor of the on-time probability, so a stalled pipeline cannot admit without bound.
MIN_ON_TIME_PROBABILITY = 0.1
#: Completions (decayed: about two) an in-flight count needs before its mean latency enters
#: the load model.
MIN_LOAD_COMPLETIONS = 1.5
#: The load model applies only once latency is seen to grow with load: measured at in-flight
#: counts at least this far apart (highest / lowest) ...
MIN_LOAD_SPREAD = 1.25
#: ... with latency rising by at least this share of what a saturated server gives (latency
#: proportional to load). Rollouts whose latency does not depend on load are never capped.
MIN_QUEUEING_SHARE = 0.5


def latency_tail(completed: Sequence[float], cancelled: Sequence[float]) -> float | None:
    """The slow decile of rollout latency over its median, from completed rollouts' times and
    cancelled ones' times run (both sorted); None while the data cannot tell.

    A cancelled rollout is right-censored: it would have taken longer than it ran, by how much
    nobody saw. At `max_steps_off_policy == 0` most racers are cancelled the moment a batch
    fills, so the completed times are each race's winners, the fastest few of many, and look
    alike whatever the latencies are. The Kaplan-Meier product-limit estimate counts each
    cancelled rollout as at risk until it was cancelled and no further, which is unbiased
    where cancelling does not depend on how long a rollout still had to run (a batch filling
    does not). The quantiles are read only once the estimate falls through its slow decile
    with `MIN_TAIL_SAMPLES` completions at or past its median; a wide race alone never gets
    there, and the gate lets a loser of each race run on until it does (`PolicyGate`).
    """
    if len(completed) < MIN_RACE_SAMPLES:
        return None
    at_risk = len(completed) + len(cancelled)
    survival, median, past_median = 1.0, None, 0
    j = 0
    for seconds in completed:
        # Rollouts cancelled before this one completed are no longer at risk.
        while j < len(cancelled) and cancelled[j] < seconds:
            j += 1
            at_risk -= 1
        survival *= 1.0 - 1.0 / at_risk
        at_risk -= 1
        if median is None and survival <= 0.5:
            median = seconds
        if median is not None:
            past_median += 1
            if survival <= 0.1:
                if past_median < MIN_TAIL_SAMPLES or median <= 0:
                    return None
                return seconds / median
    return None


def latency_grows_with_load(load_latency: tuple[tuple[int, float, float], ...]) -> bool:
    """The load model (`GateSnapshot.load_latency`) shows latency growing with the number in
    flight: measured at counts `MIN_LOAD_SPREAD` apart, rising at least `MIN_QUEUEING_SHARE`
    as fast as a saturated server's."""
    if len(load_latency) < 2:
        return False
    low, high = load_latency[0], load_latency[-1]
    if low[0] <= 0:
        return False
    spread = high[0] / low[0]
    if spread < MIN_LOAD_SPREAD:
        return False
    return high[1] >= low[1] * (1 + MIN_QUEUEING_SHARE * (spread - 1))


def _server_throughput(load_latency: tuple[tuple[int, float, float], ...]) -> float | None:
    rates = [n / latency for n, latency, _ in load_latency if latency > 0]
    if not rates or len(rates) < len(load_latency):
        return None
    return max(rates)


#: The last load model read, and what it said (throughput, queueing). The gate hands the same
#: tuple to every snapshot until it refits the model (every `TIME_REFRESH` rollouts), while
#: the load cap is read at every admission decision: a tuple is immutable, so one that is
#: the same object says the same.
_last_reading: tuple[object, tuple[float | None, bool]] = ((), (None, False))


def _read_load_model(
    load_latency: tuple[tuple[int, float, float], ...],
) -> tuple[float | None, bool]:
    global _last_reading
    model, reading = _last_reading
    if model is not load_latency:
        reading = (_server_throughput(load_latency), latency_grows_with_load(load_latency))
        _last_reading = (load_latency, reading)
    return reading


@cheap_init
@dataclass(frozen=True, slots=True)
class MeasuredSnapshot(GateSnapshot):
    """The gate's snapshot with the measurements staleness-aware admission decides from."""

    #: The load model: `(in-flight count, mean latency there, completions behind the mean)`
    #: by count (a rollout's count is the mean number in flight while it ran), only counts
    #: with at least `MIN_LOAD_COMPLETIONS`. Empty until measured: no load cap.
    load_latency: tuple[tuple[int, float, float], ...] = ()
    #: For recent rollouts that started together with others (a cohort), how much later than
    #: the cohort's median each ended, in seconds (`math.inf`: cancelled first), sorted.
    #: Empty: none measured.
    cohort_lateness: tuple[float, ...] = ()
    #: The slow decile of rollout latency over its median, with cancelled rollouts counted as
    #: censored (`latency_tail`); None: not measured.
    latency_tail: float | None = None
    #: Share of recent groups the trainer found trainable: the rest scored alike (zero
    #: variance) and were discarded. 1.0 until one is.
    trainable_share: float = 1.0

    @property
    def pipeline_target(self) -> int | None:
        """Groups in flight or ready that keep the trainer busy without aging them.

        By Little's law a trainer taking B groups every step period T needs B * L / T
        rollouts of latency L in flight, plus one batch ready when it asks for it.
        """
        if self.rollout_latency is None or not self.step_period:
            return None
        in_flight = self.max_batch_size * self.rollout_latency / self.step_period
        if not math.isfinite(in_flight):
            return None  # steps measured as taking no time at all: nothing to cap
        return self.max_batch_size + math.ceil(in_flight)

    @property
    def rollout_spread(self) -> float | None:
        """How much later than a typical rollout the slow ones end (None: too few measured).

        A high quantile of recent rollout times minus their median; infinite when more than
        the quantile's tail were cancelled for missing their window.
        """
        times = self.recent_rollout_times
        if len(times) < MIN_TIME_SAMPLES:
            return None
        median = times[(len(times) - 1) // 2]
        slow = times[int(STRAGGLER_QUANTILE * (len(times) - 1))]
        return math.inf if math.isinf(slow) else slow - median

    @property
    def racers_end_together(self) -> bool:
        """Rollouts take about as long as each other: the slow decile of their latency ends
        within `RACE_SPREAD` times its median (`latency_tail`, cancelled rollouts counted as
        censored), or rollouts that started together end within `COHORT_LATE_SHARE` of a step
        of their cohort's median (the slow decile of `cohort_lateness`).

        The second test is the one that survives a policy changing its answers' length over
        a run (from 60 tokens to 2 and back, say): the run's times then spread far apart
        while the rollouts of each publish still end in the same step.

        Where it holds, racing more rollouts than a batch needs does not get the batch sooner:
        the extra racers end with the winners, and at a shared server that batches them
        (vLLM, art_trio's CPU server) they slow the winners down. Independent latencies with a
        long tail (each rollout its own environment) fail it: there the fastest of many end
        far sooner than the median. Neither test judges from a race's winners alone: the first
        counts the losers as censored, the second as infinitely late.
        """
        if self.latency_tail is not None and self.latency_tail <= RACE_SPREAD:
            return True
        late = self.cohort_lateness
        return (
            len(late) >= MIN_RACE_SAMPLES
            and self.step_period is not None
            and late[int(0.9 * (len(late) - 1))] <= COHORT_LATE_SHARE * self.step_period
        )

    def straggler_slack(self, beyond_bound: int) -> int:
        """The part of `beyond_bound` worth admitting at the measured pace.

        The slack is for stragglers: rollouts of a batch that end after the trainer wants it.
        Where the slow rollouts end only a small part of a step after the typical one (short
        or steady latencies: `rollout_spread` far below `step_period`), a batch's rollouts all
        end together and the extra rollouts would only go stale.
        """
        if self.rollout_spread is None or not self.step_period:
            return beyond_bound
        reach = self.rollout_spread / self.step_period
        return math.floor(beyond_bound * min(1.0, reach) + 0.5)

    @property
    def on_time_probability(self) -> float:
        """Chance that a rollout started now finishes before its window closes.

        The window closes about `batches_left` step periods from now. The chance is the share
        of recent rollouts that took no longer (cancelled ones count as late); until enough
        have ended, latencies are taken as exponential with the measured mean (the memoryless
        worst case for a given mean).
        """
        if not self.step_period:
            return 1.0  # steps not measured yet: assume all are on time
        window = self.batches_left * self.step_period
        times = self.recent_rollout_times
        if len(times) >= MIN_TIME_SAMPLES:
            on_time = bisect.bisect_right(times, window) / len(times)
        elif not self.rollout_latency:
            return 1.0  # unmeasured yet, or rollouts that take no time: all are on time
        else:
            on_time = 1.0 - math.exp(-window / self.rollout_latency)
        return max(MIN_ON_TIME_PROBABILITY, on_time)

    @property
    def load(self) -> int:
        """Rollouts in flight now, fresh or not (what a shared server is serving for us)."""
        return self.fresh_in_flight if self.in_flight is None else self.in_flight

    @property
    def server_throughput(self) -> float | None:
        """Rollouts per second the shared server completes at best, as measured (None: not
        measured, or rollouts that take no time, which no load slows)."""
        return _read_load_model(self.load_latency)[0]

    @property
    def queueing(self) -> bool:
        """Latency measured to grow with the number in flight (see the module's docstring)."""
        return _read_load_model(self.load_latency)[1]

    @property
    def uncontended_latency(self) -> float | None:
        """Mean latency at the lowest load measured (None: not measured)."""
        if not self.load_latency:
            return None
        return min(self.load_latency)[1]

    def latency_at(self, load: int) -> float | None:
        """Expected rollout latency with `load` rollouts in flight (None: no load model)."""
        throughput, floor = self.server_throughput, self.uncontended_latency
        if throughput is None or floor is None:
            return None
        return max(floor, load / throughput)

    @property
    def load_cap(self) -> int | None:
        """Most rollouts in flight at once that can each finish inside the freshness window.

        The window of a rollout admitted now closes about `batches_left` step periods from
        now; with n in flight the server finishes them in n / X, so at most X * window may
        run (never below 1, so a pipeline with nothing in flight always makes progress).
        None while the load model or the step period is not measured, or latency is not seen
        to grow with load: no cap.
        """
        throughput = self.server_throughput
        if throughput is None or not self.step_period or not self.queueing:
            return None
        room = throughput * self.batches_left * self.step_period
        if not math.isfinite(room):
            return None
        return max(1, math.floor(room))

    def held_by(
        self, headroom: Callable[[GateSnapshot], float]
    ) -> tuple[str, str, str] | None:
        """The load cap, where the same decision without the load model would admit one: the
        freshness window has room, the shared server has none."""
        cap, throughput = self.load_cap, self.server_throughput
        if (
            cap is None or throughput is None or not self.step_period
            or headroom(replace(self, load_latency=())) <= 0
        ):
            return None
        return (
            "the load cap",
            f"the shared inference server can take {cap} at once, {self.load} run there",
            f"the load cap admits no rollout while {self.load} run on the shared inference "
            f"server, which can take {cap} at once and finish them inside the freshness window "
            f"(measured {throughput:.3g} rollouts/s over {self.batches_left} step periods of "
            f"{self.step_period:.1f} s); each rollout that ends lets one start",
        )
