"""The online autotuner's policy: the cheapest worker count that keeps the trainer fed.

`AutotunePolicy` is pure: it sees successive `RunStatistics` snapshots (one after each
trained step) and now and then returns a `Decision` (a new worker count, sometimes a new
`min_batch_size`, always a reason). It reads no clock and touches no trainer, so it is
tested on its own and in the simulator (virtual time); `stage.py` runs it in a
live `train()`.

What it looks for: the fewest rollout workers whose trainer utilization (the share of a
window's wall time the trainer did not wait for groups: its own per-step work is not
starvation) stays at or above `target` (0.95).
Fewer workers cost fewer rollout-seconds per trained group (less inference queueing on a
shared server, fewer rollouts thrown away as stale); below the threshold the trainer
waits for groups. The search is a bracket: the largest count seen to starve the trainer
(`low`) and the smallest seen to feed it (`high`). A window below the target moves up
(toward `high`, or by the measured shortfall and Little's law when no `high` is known); a
window at the target moves down (halfway to `low`, or by Little's law's estimate of the
rollouts in flight the trainer needs). When `high` is the next count above `low` (or within
`settle_fraction` of it) the search has settled and holds. Hysteresis:

- a window right after a change is not judged (`skip_steps_after_change`), nor, after a
  decrease, until the larger pool's backlog is trained or stale
  (`skip_steps_after_decrease`);
- a window counts as "fed" only at `target + band` or more and as "starved" below `target`;
  between the two it holds. The band lies above the target so that the count the search
  settles on was seen with a margin, and its windows' noise stays at or above the target;
- a verdict that would settle the search (fed next to a starved count, or starved next to a
  fed one) waits until the mean of two windows or more at the count lies on the same side
  of the target: one window of 64 groups reads up to a tenth off the truth, and a search
  settled on it stays there for the rest of the run;
- no probe down is begun that could not be judged by the run's last step (`max_steps`):
  the run would end on a count nobody judged;
- a count once seen feeding the trainer is given up only for drift (the workload changed:
  rollouts got slower), and only when the utilization at this count, averaged over
  `drift_horizon` windows (an exponentially weighted mean), is below the target too: after
  `drift_windows` windows in a row more than `drift_margin` below the target (a clear
  drop: the search resumes, sized by the shortfall), or from `drift_span` windows at this
  count on (a slow slide: a notch up). A single window a little under the target is noise
  (4-step windows of exponential latencies vary by a few hundredths) and moves nothing; the
  average's noise shrinks with the horizon, so a count that feeds the trainer is not given up
  by chance late in a long run.

Where no worker count reaches the target (the staleness bound or the train step itself holds
the trainer back, not the workers), more workers only wait: the search stops growing at
`little_factor` times the rollouts in flight Little's law says the trainer's pace needs, and
a starved run above that comes down to it and holds there. That count becomes a ceiling
(Little's estimate moves by tens of percent from window to window; a ceiling that moved with
it would have the count flap), lifted only when the estimate outgrows it twice over (the
rollouts got slower). (On-policy races are not cut by
this: their cancelled racers lower the yield, which raises Little's estimate with them.)

Optionally an inference server's load (vLLM's running and waiting requests, `InferenceLoad`)
stops it adding workers that would only wait in the server's queue.

(About 530 lines, over the project's ~400: this docstring and one class whose judgement
steps all read and move the same bracket, ceiling and drift state; split across modules
they would have to pass it around.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..messages.events import RunStatistics
from .window import Decision, InferenceLoad, Window, measure

#: Trainer utilization the autotuner keeps unless told otherwise.
DEFAULT_TARGET_UTILIZATION = 0.95


@dataclass
class AutotunePolicy:
    """Decides worker counts from successive statistics (see the module docstring)."""

    num_rollout_workers: int
    min_batch_size: int
    max_batch_size: int
    target: float = DEFAULT_TARGET_UTILIZATION
    min_workers: int = 1
    max_workers: int = 1024
    #: Steps per judged window, and steps at the start of the run not judged (warm-up).
    window_steps: int = 4
    warmup_steps: int = 3
    #: A window also spans at least this many trained groups (short windows are noise).
    min_window_groups: int = 64
    #: Steps after a change before a window starts (they still ran at the old size).
    skip_steps_after_change: int = 1
    #: Steps after a decrease before a window starts: groups the larger pool rolled out
    #: still feed the trainer until the staleness bound retires them, so a window begun
    #: sooner sees a smaller pool fed by its predecessor's backlog (the trainer sets this to
    #: `max_steps_off_policy + 1`).
    skip_steps_after_decrease: int = 1
    #: A window is "fed" only at `target + band` or more, "starved" below `target` (between:
    #: hold).
    band: float = 0.02
    #: Settled when `high - low <= max(1, settle_fraction * high)`.
    settle_fraction: float = 0.1
    #: Windows in a row more than `drift_margin` below the target at a count once seen
    #: feeding the trainer before the search resumes above it...
    drift_windows: int = 2
    drift_margin: float = 0.04
    #: ...or, from `drift_span` windows at this count on, their average (exponentially
    #: weighted over `drift_horizon` windows) below the target.
    drift_span: int = 4
    drift_horizon: int = 8
    #: Workers per rollout Little's law asks for, times this, is the first guess.
    headroom: float = 1.5
    #: Workers per rollout Little's law asks for, times this, is the most a starved trainer
    #: is given: beyond it, workers are not what it lacks.
    little_factor: float = 4.0
    #: An increase after which utilization fell by more than `harm_margin` made it worse
    #: (twice the drift margin: the window before the increase may have straddled a change
    #: of the workload)...
    harm_margin: float = 0.08
    #: ...and an increase that gains less utilization than `min_gain` while at least
    #: `stale_done_limit` of the rollouts ended stale gained nothing (twice in a row: the
    #: count before them becomes the ceiling).
    min_gain: float = 0.01
    stale_done_limit: float = 0.25
    #: Rollout latency after an increase above this times the latency before it, times the
    #: ratio of the counts, is the workload slowing down, not the added workers.
    slower_alone: float = 1.1
    #: Waiting/running requests at the inference server above which adding workers only
    #: queues them there (only with an `InferenceLoad`).
    inference_pressure_limit: float = 0.8
    #: The run's last step (None: unknown): a probe down that could not be judged by then is
    #: not begun (the run would end on a count nobody judged).
    max_steps: int | None = None
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError("target utilization must be within (0, 1]")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError("need 1 <= min_workers <= max_workers")
        self.num_rollout_workers = min(max(self.num_rollout_workers, self.min_workers),
                                       self.max_workers)
        #: Largest count seen to starve the trainer, smallest seen to feed it.
        self.low: int | None = None
        self.high: int | None = None
        #: Most workers given while starved: `little_factor` x Little's law, once reached,
        #: or a count above which more workers were seen to feed the trainer worse.
        self.ceiling: int | None = None
        #: The rollout latency when `ceiling` was set by more workers doing worse (None: a
        #: Little's law ceiling).
        self._ceiling_latency: float | None = None
        #: The utilization with more workers when they were seen to feed the trainer worse
        #: (None: no such ceiling).
        self._worse_utilization: float | None = None
        self._start: RunStatistics | None = None
        self._skip = self.warmup_steps
        self._starved_in_a_row = 0
        #: Windows judged at the current count and their weighted mean utilization (reset
        #: on every change).
        self._here = 0
        self._here_utilization = 1.0
        self.settled_at_step: int | None = None
        #: A window has fed the trainer since the search (re)started: moves up from here are
        #: sized by the shortfall, not the first search's jumps.
        self._fed_once = False
        #: The window after an increase fell below the one before it: the next decides.
        self._harm_pending = False
        #: The count and utilization before the last increase (None: the last change was
        #: not an increase, or it has been judged).
        self._before_increase: tuple[int, float, float | None] | None = None
        #: The count and utilization before the first of a run of increases that gained
        #: nothing while rollouts were discarded as stale.
        self._flat_since: tuple[int, float] | None = None
        #: Sizes the user set with `trainer.resize` during the run: theirs win, the tuner
        #: leaves these fields alone from then on.
        self.pinned: dict[str, int] = {}

    # -- the run's own sizes ---------------------------------------------------------------

    def sync(self, num_rollout_workers: int, min_batch_size: int, max_batch_size: int) -> None:
        """Adopt the run's live settings before judging (an executor's clamp, a resize the
        tuner was not told of): decisions start from what runs, never from a stale copy."""
        if num_rollout_workers != self.num_rollout_workers:
            self._restart_window()  # the window so far measured another count
        self.num_rollout_workers = num_rollout_workers
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size

    def user_resized(
        self,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        """The user resized the run (`trainer.resize`): the user wins. Each field given is
        adopted and pinned (the tuner does not change it again in this run); what was
        measured under the old sizes no longer applies, so the search starts over from the
        new ones (bracket, ceiling, window)."""
        given = {"num_rollout_workers": num_rollout_workers, "min_batch_size": min_batch_size,
                 "max_batch_size": max_batch_size}
        for name, value in given.items():
            if value is not None:
                self.pinned[name] = int(value)
                setattr(self, name, int(value))
        self.min_batch_size = min(self.min_batch_size, self.max_batch_size)
        self.low = self.high = self.ceiling = self._ceiling_latency = None
        self._worse_utilization = None
        self._before_increase = self._flat_since = None
        self.settled_at_step = None
        self._fed_once = False
        self._restart_window()

    def _restart_window(self, skip: int | None = None) -> None:
        self._skip = max(self._skip, self.skip_steps_after_change if skip is None else skip)
        self._start = None
        self._here = 0
        self._here_utilization = 1.0
        self._starved_in_a_row = 0
        self._harm_pending = False

    # -- the one entry point ---------------------------------------------------------------

    def observe(
        self, stats: RunStatistics, inference: InferenceLoad | None = None
    ) -> Decision | None:
        """Feed the statistics after a step; a `Decision` once a window is complete."""
        if self._skip > 0:
            self._skip -= 1
            self._start = None if self._skip > 0 else stats
            return None
        if self._start is None:
            self._start = stats
            return None
        if stats.steps - self._start.steps < self.window_steps or (
            stats.trained - self._start.trained < self.min_window_groups
        ):
            return None
        window = measure(self._start, stats, self.num_rollout_workers)
        self._start = stats
        self._here += 1
        weight = max(1 / self._here, 1 / self.drift_horizon)
        self._here_utilization += weight * (window.utilization - self._here_utilization)
        decision = self._respect_pins(self._decide(window, stats.steps, inference))
        self.decisions.append(decision)
        if decision.changed:
            self._before_increase = (
                (self.num_rollout_workers, window.utilization, window.rollout_latency_s)
                if decision.action == "increase_workers" else None
            )
            decreased = decision.num_rollout_workers < self.num_rollout_workers
            self.num_rollout_workers = decision.num_rollout_workers
            self.min_batch_size = decision.min_batch_size
            self._restart_window(
                max(self.skip_steps_after_change, self.skip_steps_after_decrease)
                if decreased else None)
            if self._skip == 0:
                self._start = stats
            self.settled_at_step = None
        elif decision.settled and self.settled_at_step is None:
            self.settled_at_step = stats.steps
        return decision

    # -- judging a window ----------------------------------------------------------------

    def _decide(self, w: Window, step: int, inference: InferenceLoad | None) -> Decision:
        n = self.num_rollout_workers
        if w.utilization < self.target - self.drift_margin:
            self._starved_in_a_row += 1
        else:
            self._starved_in_a_row = 0
        harm = self._more_did_not_help(w, n)
        if harm is not None:
            back, why = harm
            if back is None:
                return self._hold(w, step, n, why)
            self.ceiling = max(self.min_workers, back)
            # Lifted when rollouts get much slower, not by Little's estimate (which the
            # discarded work and the contention themselves inflate).
            self._ceiling_latency = w.rollout_latency_s or math.inf
            self.low = None if self.low is not None and self.low >= back else self.low
            return self._change(w, step, n, self.ceiling, "decrease_workers",
                                f"{why}; back to {self.ceiling}, the most it is given from "
                                "now on")
        pending = self._unconfirmed(w, n)
        if pending is not None:
            return self._hold(w, step, n, pending)
        if w.utilization >= self.target + self.band:
            self.high = n if self.high is None else min(self.high, n)
            self._fed_once = True
            if self.low is not None and self.low >= n:
                self.low = None  # fed now at a count once seen starving: the load eased
            return self._fed(w, step, n)
        if w.utilization >= self.target:
            return self._in_band(w, step, n)
        return self._starved(w, step, n, inference)

    def _unconfirmed(self, w: Window, n: int) -> str | None:
        """Why a verdict that would settle the search waits for another window, or None.

        A window reads up to a tenth off the truth, and a verdict next to the other end of
        the bracket ends the search: the mean of two windows or more at this count must lie
        on the same side of the target.
        """
        fed = w.utilization >= self.target + self.band
        if fed:
            settles = self.low is not None and self._closed(n)
        elif w.utilization < self.target:
            settles = self.high is not None and n < self.high and self._closed(self.high, n)
        else:
            return None
        agrees = (self._here_utilization >= self.target) == fed
        if not settles or (self._here >= 2 and agrees):
            return None
        return (f"utilization {w.utilization:.3f} at {n} workers would settle the search "
                f"({'fed' if fed else 'starved'}); {self._here_utilization:.3f} over "
                f"{self._here} window(s) here: judged with the next window")

    def _in_band(self, w: Window, step: int, n: int) -> Decision:
        band = (f"utilization {w.utilization:.3f} inside the band "
                f"[{self.target:.2f}, {self.target + self.band:.2f})")
        needed = w.workers_needed
        if needed and n > self.little_factor * needed and not self._closed(n):
            # Far more workers than the pace needs in flight (a loaded host keeps the
            # trainer just inside the band at any count): probe down as if fed.
            self.high = n if self.high is None else min(self.high, n)
            down = max(self.min_workers, _ceil(needed * self.headroom))
            if self.low is not None:
                down = max(down, (self.low + n) // 2)
            if down < n:
                return self._change(
                    w, step, n, down, "decrease_workers",
                    f"{band}, but {n} workers are over {self.little_factor:g}x the "
                    f"~{needed:.1f} in flight Little's law needs: probing down")
        return self._hold(w, step, n, band)

    def _fed(self, w: Window, step: int, n: int) -> Decision:
        util = f"utilization {w.utilization:.3f} >= {self.target + self.band:.2f} at {n} workers"
        if self._closed(n):
            return self._hold(w, step, n, f"{util}; settled ({self._bracket()})", settled=True)
        if self.low is not None:
            down = (self.low + n) // 2
            why = f"{util}; halfway down to {self.low} (starved)"
        else:
            guess = _ceil(w.workers_needed * self.headroom) if w.workers_needed else n
            # Little's law's guess with headroom if it is below (a sixteenth of the count at
            # least: from hundreds of workers, quarters would spend windows far from the
            # answer); else probe a quarter down.
            down = max(guess if guess < n else (3 * n) // 4, n // 16)
            why = (f"{util}; Little's law needs ~{w.workers_needed:.1f} in flight"
                   if w.workers_needed else f"{util}; halving")
        down = max(self.min_workers, min(down, n - 1))
        if down >= n or (self.low is not None and down <= self.low):
            return self._hold(w, step, n, f"{util}; settled ({self._bracket()})", settled=True)
        if self.max_steps is not None and step + self._steps_to_judge(w) > self.max_steps:
            return self._hold(w, step, n, f"{util}; a probe down could not be judged by the "
                              f"last step ({self.max_steps})")
        return self._change(w, step, n, down, "decrease_workers", why)

    def _starved(
        self, w: Window, step: int, n: int, inference: InferenceLoad | None
    ) -> Decision:
        util = f"utilization {w.utilization:.3f} < {self.target:.2f} at {n} workers"
        slide = drop = False
        if self.high is not None and self.high <= n:
            # A count once seen feeding the trainer starves it now: drift, or noise.
            drift = self._drift()
            if drift is None:
                return self._hold(
                    w, step, n, f"{util}; drift? ({self._starved_in_a_row}/{self.drift_windows}"
                    f" windows below {self.target - self.drift_margin:.2f}; average of "
                    f"{self._here} windows here {self._here_utilization:.3f})")
            util = f"{util}; drift: {drift}"
            # A slow slide (the average, not a clear drop): a notch more is the next thing
            # to try, not a jump sized by one window's shortfall.
            slide = self._starved_in_a_row < self.drift_windows
            drop = not slide
            self.high = None
        cap = self._starved_cap(w)
        if cap is not None and n >= cap:
            # Far more in flight than the trainer's pace needs, and still starved: the
            # staleness bound or the train step holds it back. Fewer workers feed it as well.
            self.ceiling = cap = max(self.min_workers, cap)
            why = (f"{util}; {n} workers already >= {cap}, " + (
                "the most it is given since more workers did not help"
                if self._ceiling_latency is not None else
                f"{self.little_factor:g}x the ~{w.workers_needed or 0:.1f} in flight Little's "
                "law needs: more do not feed it"))
            if cap < n:
                return self._change(w, step, n, cap, "decrease_workers", why)
            return self._hold(w, step, n, why, settled=True)
        self.low = n if self.low is None else max(self.low, n)
        # Where no worker may be added: hold for a saturated inference server; at
        # `max_workers`, smaller batches or hold.
        if inference is not None and inference.pressure > self.inference_pressure_limit:
            return self._hold(w, step, n, f"{util}; inference server saturated (waiting/"
                              f"running {inference.pressure:.2f}): more workers would queue")
        if n >= self.max_workers and self.min_batch_size > 1:
            smaller = max(1, self.min_batch_size * 3 // 4)
            return Decision(step, "lower_min_batch_size", f"{util}; at max_workers "
                            f"{self.max_workers}: smaller batches start steps sooner",
                            n, n, smaller, False, w)
        if n >= self.max_workers:
            return self._hold(w, step, n, f"{util}; at max_workers and min_batch_size 1")
        up, why = self._step_up(w, n, util, slide, drop)
        if cap is not None and up > cap:
            up, why = cap, f"{why} (capped at {self.little_factor:g}x Little's law)"
        return self._change(w, step, n, min(up, self.max_workers), "increase_workers", why)

    def _starved_cap(self, w: Window) -> int | None:
        """The most workers a starved trainer is given: the ceiling, unless rollouts got much
        slower (then it is lifted), else `little_factor` x Little's law (None: unknown)."""
        cap = _ceil(self.little_factor * w.workers_needed) if w.workers_needed else None
        if self.ceiling is None:
            return cap
        if self._ceiling_latency is not None:
            lift = (w.rollout_latency_s or 0.0) > 2 * self._ceiling_latency
        else:
            lift = cap is not None and cap > 2 * self.ceiling
        if self._worse_utilization is not None and self._here >= 2:
            # Back at the ceiling the trainer is fed no better than with more workers: the
            # fall was the workload's (it slowed while the increase was judged), not theirs.
            lift = lift or self._here_utilization <= self._worse_utilization + self.min_gain
        if lift:
            # Rollouts got slower, or the fall was not the workers': the search may grow.
            self.ceiling = self._ceiling_latency = self._worse_utilization = None
            return cap
        return self.ceiling

    def _step_up(
        self, w: Window, n: int, util: str, slide: bool, drop: bool
    ) -> tuple[int, str]:
        """How many workers a starved trainer gets next (before the cap), and why."""
        if self.high is not None:
            return max(n + 1, (n + self.high + 1) // 2), f"{util}; halfway up to {self.high} (fed)"
        notch = n + max(1, math.floor(self.settle_fraction * n))
        if slide:
            return notch, f"{util}; a notch up"
        if drop or self._fed_once:
            # Near a count that fed the trainer (a clear drop there, or the search resumed
            # above it): the count lacks what this shortfall says (utilization grows with
            # the workers below the pace's need), a notch when it was only marginal, twice it
            # when rollouts got twice as slow. The first search's jumps (a quarter at least,
            # Little's law with headroom) do not fit here: a window of 64 groups reads a
            # tenth above or below the truth, and a marginal pool judged short by one went
            # to twice what it needed, the run too far along to come back down.
            scaled = _ceil(n * min(2.0, (self.target + self.band) / max(w.utilization, 0.05)))
            return max(notch, scaled), f"{util}; scaled by the shortfall here"
        # By the shortfall as if utilization grew in proportion to workers, but by a quarter
        # at least: it does not near the target (an on-policy race gains ~0.03 per doubling
        # there), and small steps there cost a window each.
        scaled = _ceil(n * min(2.0, max(1.25, 1.1 * self.target / max(w.utilization, 0.05))))
        guess = _ceil(w.workers_needed * self.headroom) if w.workers_needed else 0
        why = f"{util}; scaled by the shortfall" + (
            f", Little's law needs ~{w.workers_needed:.1f}" if w.workers_needed else "")
        return max(n + 1, scaled, min(guess, 4 * n)), why

    # -- helpers -------------------------------------------------------------------------

    def _respect_pins(self, d: Decision) -> Decision:
        """A change to a size the user set during the run becomes a hold: theirs wins."""
        if not d.changed:
            return d
        for name, value in (("num_rollout_workers", d.num_rollout_workers),
                            ("min_batch_size", d.min_batch_size)):
            if name in self.pinned and value != self.pinned[name]:
                return Decision(d.step, "hold", f"{d.reason} (not applied: {name}="
                                f"{self.pinned[name]} was set by the user's resize, which "
                                "wins)", d.previous_workers, self.num_rollout_workers,
                                self.min_batch_size, False, d.window)
        return d

    def _more_did_not_help(self, w: Window, n: int) -> tuple[int | None, str] | None:
        """After an increase, still starved: the count to go back to if more workers did not
        feed the trainer (and why), None for it to judge one more window first, else None.

        Starvation is not always a lack of workers: more of them can compete for the host's
        CPU or the inference server (utilization falls), or, with eager admission, roll out
        work the staleness bound discards (utilization stays flat while stale discards
        grow). Read as "more workers" either ran 32 workers up to 824 (issue 25).
        """
        before, self._before_increase = self._before_increase, None
        if before is None or before[0] >= n or w.utilization >= self.target:
            self._flat_since = None
            return None
        n0, u0, latency0 = before
        util = f"utilization {w.utilization:.3f} at {n} workers"
        latency = w.rollout_latency_s
        if latency0 and latency and latency > self.slower_alone * latency0 * n / n0:
            # Rollouts got slower than the added workers could make them (a contended server
            # slows at most in proportion to what it is given): the workload changed under
            # the increase, and a fall is its doing. Read as harm, it would hold the pool at
            # the count from before a doubling of the latency for the rest of the run.
            self._flat_since = None
            self._harm_pending = False
            return None
        if self._harm_pending:
            self._harm_pending = False
            self._flat_since = None
            if self._here_utilization < u0 - self.harm_margin:
                self._worse_utilization = self._here_utilization
                return n0, (f"utilization {self._here_utilization:.3f} over {self._here} "
                            f"windows at {n} workers, below the {u0:.3f} at {n0}: more "
                            "workers made it worse")
            return None
        if w.utilization < u0 - self.harm_margin:
            # A window of 64 groups reads up to a tenth off the truth either way, so one fall
            # this size is noise as often as harm, and the ceiling it sets held a pool short
            # of the pace's need for the rest of a run: the average with the next window at
            # this count decides.
            self._flat_since = None
            self._before_increase, self._harm_pending = before, True
            return None, (f"{util}, below the {u0:.3f} at {n0}: more workers made it worse? "
                          "(judged with the next window)")
        if w.utilization < u0 + self.min_gain and w.stale_done_fraction >= self.stale_done_limit:
            if self._flat_since is None:
                self._flat_since = (n0, u0)
                return None
            first, u_first = self._flat_since
            self._flat_since = None
            self._worse_utilization = None
            return first, (f"{util}, {u_first:.3f} at {first}: two increases gained nothing "
                           f"while {w.stale_done_fraction:.0%} of the rollouts ended stale "
                           "(more workers only roll out work the staleness bound discards)")
        self._flat_since = None
        return None

    def _drift(self) -> str | None:
        """Why the windows at this count say the workload changed, or None (noise so far)."""
        # Either way the average at this count must be below the target too: two unlucky
        # windows in a row at a count that feeds the trainer are not drift.
        if self._here_utilization >= self.target:
            return None
        average = f"average utilization {self._here_utilization:.3f} over {self._here} windows"
        if self._starved_in_a_row >= self.drift_windows:
            return (f"{self._starved_in_a_row} windows in a row below "
                    f"{self.target - self.drift_margin:.2f}, {average}")
        if self._here >= self.drift_span:
            return average
        return None

    def _closed(self, n: int, low: int | None = None) -> bool:
        """Whether `n` fed and `low` (default: the bracket's) starved settle the search."""
        if low is None:
            low = self.low if self.low is not None else self.min_workers - 1
        return n - low <= max(1, math.floor(self.settle_fraction * n))

    def _steps_to_judge(self, w: Window) -> int:
        """Steps from a decrease to its verdict: the skipped steps and two windows (a verdict
        next to the other end of the bracket waits for a second)."""
        groups = math.ceil(self.min_window_groups / w.groups_per_step) if w.groups_per_step else 0
        skip = max(self.skip_steps_after_change, self.skip_steps_after_decrease)
        return skip + 2 * max(self.window_steps, groups)

    def _bracket(self) -> str:
        low = "none" if self.low is None else str(self.low)
        return f"starved at {low}, fed at {self.high}"

    def _hold(
        self, w: Window, step: int, n: int, reason: str, *, settled: bool = False
    ) -> Decision:
        return Decision(step, "hold", reason, n, n, self.min_batch_size, settled, w)

    def _change(self, w: Window, step: int, n: int, to: int, action: str, why: str) -> Decision:
        return Decision(step, action, f"{why}: {n} -> {to} workers", n, to,
                        self.min_batch_size, False, w)


def _ceil(value: float) -> int:
    return max(1, math.ceil(value - 1e-9))
