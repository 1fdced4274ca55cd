"""Policy versions and admission: the one place that decides whether a rollout may start.

Vocabulary (the reference's):
- `policy_version` is the step of the weights rollouts sample from now;
- `next_training_step` is the step the trainer is producing: equal to `policy_version` while
  it collects a batch, one more while `backend.train` runs;
- the batch that produces step s+1 accepts a group only if its `initial_policy_version` is
  at least `s - max_steps_off_policy`, so a rollout that starts at version v can still be
  trained by the batches for steps v+1 .. v+max_steps_off_policy+1: its freshness window.

Admission and freshness are decided here and nowhere else, so the rollout side (may a
rollout start?) and the training side (is this group still fresh?) can never drift apart.
Whether a rollout may start is the admission policy's decision (see admission.py), a pure
function of the `GateSnapshot` (gate_snapshot.py) the gate takes; the gate keeps the counts
it is made from. A policy that decides from more than these counts brings a subclass of this
gate that measures it (`AdmissionPolicy.gate_class`; `art_trio.admission`'s measures rollout
latency under load, cohorts and the slow tail): the subclass hooks in where a rollout ends
(`_rollout_measured`), where the in-flight count changes (`_load_changing`), where the trainer
judges groups trainable or not (`_groups_judged`) and where doomed rollouts are cancelled
(`_cancel_doomed`).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Collection

import anyio
import anyio.lowlevel

from ..messages.errors import _GateClosed
from ..plumbing.group_queue import LoopEvent
from .admission import AdmissionPolicy, EagerAdmission
from .gate_snapshot import GateSnapshot, completed_count

#: Weight of the newest sample in the step-period average.
EWA_ALPHA = 0.2
#: Per-rollout decay of the latency estimate's sums: it follows roughly the last 100 rollouts.
LATENCY_DECAY = 0.99
#: Recent rollout times the gate keeps, re-sorted every TIME_REFRESH rollouts (and every one
#: while fewer than TIME_REFRESH are known).
RECENT_TIMES = 256
TIME_REFRESH = 32
#: `GateSnapshot`'s fields in its order: policy version, next training step, window, batch
#: size, queued, fresh in flight, rollout latency, step period, recent times, in flight.
_SnapshotFields = tuple[
    int, int, int, int, int, int, "float | None", "float | None", "tuple[float, ...]", int
]


def _ewa(previous: float | None, value: float) -> float:
    return value if previous is None else EWA_ALPHA * value + (1 - EWA_ALPHA) * previous


class _Waiter:
    __slots__ = ("event", "version")

    def __init__(self, event: LoopEvent) -> None:
        self.event = event
        #: The version whose slot `_pump` took for this waiter; None until admitted.
        self.version: int | None = None


class PolicyGate:
    """Holds policy versions and the pipeline's occupancy; admits rollouts in FIFO order.

    Waiting workers queue up and are woken one at a time as admission frees up, so a policy
    update wakes exactly the workers that may start instead of every worker at once.

    Every change that can raise the headroom ends by waking the waiters it lets in (`_pump`):
    nothing else wakes them, so a change that raised it unannounced would leave workers
    waiting for an event that may never come, with nothing in flight to bring it. A rollout's
    end is one decision, not one per call it makes: its time note is followed by its
    `rollout_done` (which decides) or its `hand_over` (which raises the headroom only under
    the load cap, and decides there).
    """

    def __init__(
        self,
        *,
        start_step: int,
        max_steps_off_policy: int,
        max_batch_size: int,
        policy: AdmissionPolicy | None = None,
        clock: Callable[[], float] = anyio.current_time,
        new_event: Callable[[], LoopEvent] = anyio.Event,
        cancel_window: int | None = None,
    ) -> None:
        # The gate's state changes only through its methods; the stages read it through the
        # properties below.
        self._policy_version = start_step
        self._next_training_step = start_step
        self._max_steps_off_policy = max_steps_off_policy
        # Versions behind the step being trained at which a running rollout is cancelled:
        # the window, or wider where in-flight updates freshen its later tokens
        # (`Freshness.cancel_window`).
        self._cancel_window = max_steps_off_policy if cancel_window is None else cancel_window
        self._max_batch_size = max_batch_size
        self._policy: AdmissionPolicy = policy or EagerAdmission()
        self._queued = 0
        self._in_flight: Counter[int] = Counter()
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        # Cancel scopes of running rollouts by version, so rollouts no batch can train any
        # more are cancelled at once instead of finishing only to be thrown away.
        # (Dicts, not sets, so cancellation order is the admission order, not memory order:
        # runs in virtual time replay exactly.)
        # Each scope's value is when its rollout started.
        self._rollout_scopes: dict[int, dict[anyio.CancelScope, float]] = {}
        # Measured pace of the pipeline (exponentially weighted), for `pipeline_target`.
        self._clock = clock
        self._new_event = new_event
        self._latency_time = 0.0
        self._latency_completions = 0.0
        self._step_period_ewa: float | None = None
        self._last_step_began: float | None = None
        # Seconds from a batch taken to its step published (exponentially weighted).
        self._train_call_ewa: float | None = None
        # (seconds run, completed) of recent rollouts.
        self._recent_times: deque[tuple[float, bool]] = deque(maxlen=RECENT_TIMES)
        self._since_sorted = 0
        self._sorted_times: tuple[float, ...] = ()
        #: Rollouts admitted and not yet ended, fresh or not.
        self._load = 0
        #: A group handed over frees a slot the policy counts (a shared server's): decide.
        self._hand_over_frees = False

    # -- what the stages read -----------------------------------------------------------

    @property
    def policy(self) -> AdmissionPolicy:
        return self._policy

    @property
    def policy_version(self) -> int:
        """The step of the weights rollouts sample from now."""
        return self._policy_version

    @property
    def next_training_step(self) -> int:
        """The step the trainer produces: `policy_version` while it collects a batch, one
        more while `backend.train` runs."""
        return self._next_training_step

    @property
    def queued(self) -> int:
        """Groups handed over and not yet taken into a batch or discarded."""
        return self._queued

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_steps_off_policy(self) -> int:
        return self._max_steps_off_policy

    # -- decisions -----------------------------------------------------------------------

    def snapshot(self) -> GateSnapshot:
        # Every rollout the gate lets run may still deliver a group a coming batch takes
        # (with in-flight updates, past the start version's window where that can pay: see
        # `_effective_cancel_window`), and batches take the oldest first: all of them come
        # before a rollout started now.
        return GateSnapshot(*self._snapshot_fields())

    def _snapshot_fields(self) -> _SnapshotFields:
        """`GateSnapshot`'s fields, in its order (positional: a snapshot is taken at every
        admission decision, and keywords through a dict cost a third of it; mypy checks the
        order against the fields' types)."""
        floor = self.min_fresh_version
        fresh = 0
        for version, count in self._in_flight.items():
            if version >= floor:
                fresh += count
        return (
            self._policy_version,
            self._next_training_step,
            self._max_steps_off_policy,
            self._max_batch_size,
            self._queued,
            fresh,
            self.rollout_latency,
            self._step_period_ewa,
            self._sorted_times,
            self._load,
        )

    @property
    def rollout_latency(self) -> float | None:
        """Mean rollout latency, counting cancelled rollouts' time as censored samples.

        Cancelled rollouts are the slow ones; leaving them out would make rollouts look
        faster than they are. For exponential latencies this (decayed) total time over
        completions is the maximum-likelihood mean.
        """
        if self._latency_completions <= 0:
            return None
        return self._latency_time / self._latency_completions

    @property
    def step_period(self) -> float | None:
        """Mean time between two steps starting (exponentially weighted; None until two)."""
        return self._step_period_ewa

    def note_rollout_time(self, seconds: float, *, completed: bool) -> None:
        """A rollout ran `seconds`, and either completed or was cancelled before it could.

        Noted as the rollout ends, just before its `rollout_done` or `hand_over`, which wake
        the waiters (a hand-over only where the load cap can hold). A new time can move the
        pace the window's rules read, but never so that a run with nothing in flight keeps
        waiting: the next step's batch or publish decides again.
        """
        self._latency_time = self._latency_time * LATENCY_DECAY + seconds
        self._latency_completions = self._latency_completions * LATENCY_DECAY + completed
        self._recent_times.append((seconds, completed))
        self._since_sorted += 1
        # Every rollout while few are known (a measuring policy reads them from a few on).
        refresh = self._since_sorted >= TIME_REFRESH or len(self._recent_times) <= TIME_REFRESH
        if refresh:
            self._since_sorted = 0
            done: list[float] = []
            cancelled: list[float] = []
            for t, ok in self._recent_times:
                (done if ok else cancelled).append(t)
            done.sort()
            cancelled.sort()
            # A cancelled rollout missed its window: for on-time chances and stragglers it is
            # late, however long it ran.
            self._sorted_times = tuple(done) + (math.inf,) * len(cancelled)
            self._rollout_measured(seconds, completed, done, cancelled)
        else:
            self._rollout_measured(seconds, completed, None, None)

    def _rollout_measured(
        self, seconds: float, completed: bool, done: list[float] | None,
        cancelled: list[float] | None,
    ) -> None:
        """A measuring gate's hook: a rollout ran `seconds` (and `done`/`cancelled` are the
        recent times, sorted, when they were just re-sorted; else None)."""

    @property
    def min_fresh_version(self) -> int:
        """Rollouts in flight that started before this are cancelled: no batch not yet taken
        could train their groups."""
        return self._next_training_step - self._effective_cancel_window()

    def _effective_cancel_window(self) -> int:
        """The cancel window in force: `_cancel_window`, unless in-flight updates widened it
        where they cannot freshen anything.

        A rollout past the start version's window can be trained only with tokens decoded
        after the coming publish: the mean bound needs at least as many of those as of its
        tokens from before the step now ending (older still), so it must run on for a
        training call and then as long again as it ran before: two training calls at the
        least. Where the median recent rollout is shorter than that, one still running when
        a batch is taken ends too old; it is cancelled at the start version's window, as
        without in-flight updates, and its slot goes to a rollout that can be trained. (Not
        the slow tail: rollouts decoding beside a training call on shared cores stretch past
        two of them while decoding few tokens, so the tail would keep the wider window for
        rollouts that end stale.) Until a rollout has completed and a step has been
        published, nothing shows that rollouts outlast training, and the start version's
        window stands.
        """
        window = self._cancel_window
        if window == self._max_steps_off_policy:
            return window
        times = self._sorted_times
        completed = completed_count(times)
        train = self._train_call_ewa
        if train is not None and completed and times[completed // 2] >= 2 * train:
            return window
        return self._max_steps_off_policy

    def may_start(self) -> bool:
        return not self._closed and self._headroom() > 0

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    @property
    def spared(self) -> Collection[anyio.CancelScope]:
        """Scopes of doomed rollouts a measuring gate left running (none here)."""
        return ()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the rollout side ----------------------------------------------------------------

    async def admit(self) -> int:
        """Wait until a rollout may start; return the policy version it starts at.

        The caller then owns one in-flight slot and must give it back with `rollout_done`.
        Raises _GateClosed once the run stops admitting.
        """
        if self._closed:
            raise _GateClosed
        if not self._waiters and self.may_start():
            # This is the worker's one yield between two rollouts (its hand-over does not wait
            # unless the channel is full): rollouts that ended in the same instant hand their
            # groups over first, so the decision below counts them.
            await anyio.lowlevel.checkpoint()
            if self._closed:
                raise _GateClosed
            if not self._waiters and self.may_start():
                return self._take_slot()
        waiter = _Waiter(self._new_event())
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.version is not None:
                # Admitted and cancelled in the same breath: hand the slot back.
                self.rollout_done(waiter.version)
            else:
                self._discard_waiter(waiter)
            raise
        if waiter.version is None:
            raise _GateClosed
        return waiter.version

    def rollout_done(self, version: int) -> None:
        """A rollout admitted at `version` ended without handing a group over."""
        self._release(version)
        self._pump()

    def hand_over(self, version: int) -> None:
        """A rollout admitted at `version` is handing its group to the channel."""
        self._release(version)
        self._queued += 1
        # Under the window rules the group only moves from in flight to queued, which never
        # raises the headroom; under a load cap (art_trio.admission) it leaves the shared
        # server, which may: a measuring gate says when. Counted queued first, so no waiter
        # is let into the slot the window still owes this group.
        if self._hand_over_frees:
            self._pump()

    # -- the training side ---------------------------------------------------------------

    def group_discarded(self, *, scored_alike: bool = False) -> None:
        """A handed-over group left the queue untrained: discarded by the trainer (stale, or
        `scored_alike`: zero variance, no learning signal), or dropped at stop (a cancelled
        hand-over, or left in the channel)."""
        self._queued -= 1
        if scored_alike:
            self._groups_judged(0, 1)
        self._pump()

    def begin_training(self, step: int, batch_size: int) -> None:
        """A batch of `batch_size` delivered groups goes to `backend.train` to produce `step`.

        Taking the batch and starting the step are one change, so admission never sees the
        groups gone while the window still counts the batch being collected.
        """
        self._queued -= batch_size
        self._groups_judged(batch_size, 0)
        now = self._clock()
        if self._last_step_began is not None:
            self._step_period_ewa = _ewa(self._step_period_ewa, now - self._last_step_began)
        self._last_step_began = now
        self._next_training_step = step
        if self._policy.cancels_doomed_rollouts:
            floor = self.min_fresh_version
            doomed = [v for v in self._rollout_scopes if v < floor]
            self._cancel_doomed([self._rollout_scopes.pop(v) for v in doomed], now)
        self._pump()

    def _cancel_doomed(self, doomed: list[dict[anyio.CancelScope, float]], now: float) -> None:
        """Cancel the rollouts no batch still to be taken can train (scopes with their start
        times, by version, oldest first); a measuring gate may let one run on."""
        for scopes in doomed:
            for scope in scopes:
                scope.cancel()

    def track(self, version: int, scope: anyio.CancelScope) -> None:
        """Register a running rollout's scope: it is cancelled once no batch can train it."""
        if self._policy.cancels_doomed_rollouts and version < self.min_fresh_version:
            scope.cancel()
            return
        self._rollout_scopes.setdefault(version, {})[scope] = self._clock()

    def untrack(self, version: int, scope: anyio.CancelScope) -> None:
        scopes = self._rollout_scopes.get(version)
        if scopes is not None:
            scopes.pop(scope, None)
            if not scopes:
                del self._rollout_scopes[version]

    def publish(self, version: int) -> None:
        """Weights for `version` are in place: rollouts may sample them from now on."""
        if self._last_step_began is not None and version == self._next_training_step:
            self._train_call_ewa = _ewa(
                self._train_call_ewa, self._clock() - self._last_step_began
            )
        self._policy_version = version
        self._next_training_step = version
        self._pump()

    def resize(self, max_batch_size: int) -> None:
        """The run's batches hold up to `max_batch_size` groups from now on: re-decide."""
        self._max_batch_size = max_batch_size
        self._pump()

    def dismiss(self, count: int) -> int:
        """Send up to `count` waiting workers away: their `admit` raises _GateClosed (the
        worker ends). Returns how many were waiting to be sent (a resize retires them)."""
        dismissed = 0
        while self._waiters and dismissed < count:
            # The latest to arrive first: the longest-waiting keep their turn.
            self._waiters.pop().event.set()
            dismissed += 1
        return dismissed

    def close(self) -> None:
        """Stop admitting: every waiting and future `admit` raises _GateClosed."""
        if self._closed:
            return
        self._closed = True
        while self._waiters:
            self._waiters.popleft().event.set()

    # -- internals -----------------------------------------------------------------------

    def _load_changing(self) -> None:
        """A measuring gate's hook: the in-flight count is about to change."""

    def _groups_judged(self, trainable: int, scored_alike: int) -> None:
        """A measuring gate's hook: groups the trainer took into a batch, or discarded because
        their rollouts all scored alike."""

    def _headroom(self) -> float:
        """The policy's decision now (a measuring gate also notes what bound it)."""
        return self._policy.headroom(self.snapshot())

    def _take_slot(self) -> int:
        self._load_changing()
        self._load += 1
        self._in_flight[self._policy_version] += 1
        return self._policy_version

    def _pump(self) -> None:
        if not self._waiters or self._closed:
            return
        # One decision for the whole wake-up, not one per waiter (each needs a snapshot).
        headroom = self._headroom()
        while self._waiters and headroom >= 1:
            headroom -= 1
            waiter = self._waiters.popleft()
            waiter.version = self._take_slot()
            waiter.event.set()

    def _discard_waiter(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _release(self, version: int) -> None:
        """Give back an in-flight slot; versions with none left leave the counter."""
        self._load_changing()
        self._load -= 1
        left = self._in_flight[version] - 1
        if left == 0:
            del self._in_flight[version]
        else:
            self._in_flight[version] = left  # (negative only after a bug: left for checks)
