"""Where each scenario ends up: one closed set of fates, recorded once per scenario, and the
run's counters folded from its events.

A scenario taken from the source ends exactly once, as one `Fate`, through
`FateRecord.settle`, which resolves it in the resume ledger where the fate is final, lets it
leave the gate's queue and emits `ScenarioSettled`. Everything that counts follows from the
events: `CounterFold` is the run's first observer and the only writer of its `RunCounters`;
the status line is the second (status.py). No stage counts anything by hand, so the counters
cannot drift from the ledger or from what a user's observer sees.

A rollout lost with its executor worker is not a fate: its scenario goes back to the source
and is taken again (`RolloutGivenBack`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..messages.events import (
    Collapsed,
    EmptyGroupReceived,
    EvalEnded,
    EvalStarted,
    GroupQueued,
    GroupReceived,
    HandOverBlocked,
    Observers,
    RolloutEnded,
    RolloutGivenBack,
    RolloutStarted,
    RunEvent,
    ScenarioSettled,
    Stalled,
    StepTrained,
    TrainCallEnded,
    TrainCallStarted,
)
from ..messages.values import RESOLVED_AT_ONCE, Fate

if TYPE_CHECKING:
    from ..plumbing.progress import ScenarioBook


class _Discards(Protocol):
    """Whoever keeps the queue a discarded group leaves (the policy gate)."""

    def group_discarded(self, *, scored_alike: bool = False) -> None: ...


@dataclass(slots=True)
class RunCounters:
    """Where every scenario taken from the source ended up, and what the run spent.

    `taken == trained + stale + zero_variance + errored + dropped_at_stop` once `train()`
    returned (the property tests check it).
    """

    taken: int = 0
    trained: int = 0
    stale: int = 0
    #: Of `stale`: rollouts the gate cancelled before they finished (doomed to be stale).
    stale_cancelled: int = 0
    zero_variance: int = 0
    #: Of `zero_variance`: groups with no trajectories at all (warned about).
    empty_groups: int = 0
    #: Of `trained`: groups whose rollouts all scored alike (no learning signal).
    trained_flat: int = 0
    errored: int = 0
    dropped_at_stop: int = 0
    rollouts_started: int = 0
    #: Rollouts that ended, whatever their end; evals that ended, completed or not (with
    #: `steps`, what the stall watchdog reads as the run moving).
    rollouts_ended: int = 0
    evals_ended: int = 0
    #: Stalls the watchdog reported (a stall reported again while it persists counts once).
    stalls: int = 0
    #: Rollouts whose executor worker died; their scenarios were given back and taken again
    #: (each such take is not counted in `taken` twice).
    rollouts_lost: int = 0
    delivered: int = 0
    received: int = 0
    steps: int = 0
    evals_started: int = 0
    evals_finished: int = 0
    max_queued: int = 0
    # Seconds, summed over the run (the per-step train metrics log their increments):
    #: in rollouts that completed with a group, and idle in workers before each of them;
    rollout_s: float = 0.0
    rollout_idle_s: float = 0.0
    #: blocked handing a group over to a full channel;
    put_wait_s: float = 0.0
    #: in rollouts whose groups ended stale (discarded after completing), and in rollouts the
    #: gate cancelled as doomed.
    stale_rollout_s: float = 0.0
    cancelled_rollout_s: float = 0.0
    #: in every rollout, whatever its end (errored, dropped and lost ones too): what
    #: inference cost.
    spent_rollout_s: float = 0.0
    #: inside `backend.train`, and waiting for a batch's groups.
    train_s: float = 0.0
    idle_s: float = 0.0
    staleness: Counter[int] = field(default_factory=Counter)
    #: Trained tokens x their policy age, and trained tokens (`StepTrained.token_ages`).
    token_age_sum: float = 0.0
    trained_tokens: float = 0.0
    """Trained groups by how many versions behind the policy they were trained from.

    A histogram, not a list per group, so a run of a million groups costs no more memory."""


class CounterFold:
    """Folds a run's events into its `RunCounters`: the counters' one writer.

    Also keeps what the run's statistics need beside the counters: when the first
    `backend.train` began, and whether the training stage stopped the run as collapsed. (The
    queued count is the gate's; `GroupQueued` carries it for `max_queued`.)
    """

    def __init__(self) -> None:
        self.counters = RunCounters()
        #: When the first step's `backend.train` began (None until then).
        self.first_step_at: float | None = None
        self.collapsed = False
        #: The events this fold follows, and how (see `Observers.begin_run`).
        self.routes: dict[type, Callable[[Any], None]] = {
            RolloutStarted: self._rollout_started,
            RolloutEnded: self._rollout_ended,
            RolloutGivenBack: self._given_back,
            GroupQueued: self._queued,
            HandOverBlocked: self._blocked,
            GroupReceived: self._received,
            ScenarioSettled: self._settled,
            EmptyGroupReceived: self._empty,
            TrainCallStarted: self._train_started,
            TrainCallEnded: self._train_ended,
            StepTrained: self._step_trained,
            Collapsed: self._collapsed,
            EvalStarted: self._eval_started,
            EvalEnded: self._eval_ended,
            Stalled: self._stalled,
        }

    def __call__(self, event: RunEvent) -> None:
        fold = self.routes.get(type(event))
        if fold is not None:
            fold(event)

    def _rollout_started(self, event: RolloutStarted) -> None:
        c = self.counters
        c.taken += 1
        c.rollouts_started += 1

    def _rollout_ended(self, event: RolloutEnded) -> None:
        c = self.counters
        c.rollouts_ended += 1
        c.spent_rollout_s += event.spent_s
        c.rollout_s += event.completed_s
        c.rollout_idle_s += event.idle_s

    def _given_back(self, event: RolloutGivenBack) -> None:
        self.counters.rollouts_lost += 1
        self.counters.taken -= 1  # taken again when handed out again

    def _queued(self, event: GroupQueued) -> None:
        c = self.counters
        c.delivered += 1
        if event.queued > c.max_queued:
            c.max_queued = event.queued

    def _blocked(self, event: HandOverBlocked) -> None:
        self.counters.put_wait_s += event.seconds

    def _received(self, event: GroupReceived) -> None:
        self.counters.received += 1

    def _settled(self, event: ScenarioSettled) -> None:
        c, fate = self.counters, event.fate
        if fate is Fate.TRAINED:
            c.trained += 1
        elif fate is Fate.STALE:
            c.stale += 1
            c.stale_rollout_s += event.rollout_s
        elif fate is Fate.CANCELLED_STALE:
            c.stale += 1
            c.stale_cancelled += 1
            c.cancelled_rollout_s += event.rollout_s
        elif fate is Fate.ZERO_VARIANCE:
            c.zero_variance += 1
        elif fate is Fate.ERRORED:
            c.errored += 1
        else:
            c.dropped_at_stop += 1

    def _empty(self, event: EmptyGroupReceived) -> None:
        self.counters.empty_groups += 1

    def _train_started(self, event: TrainCallStarted) -> None:
        if self.first_step_at is None:
            self.first_step_at = event.at

    def _train_ended(self, event: TrainCallEnded) -> None:
        self.counters.train_s += event.train_s

    def _step_trained(self, event: StepTrained) -> None:
        self.counters.steps += 1
        self.counters.idle_s += event.idle_s
        self.counters.trained_flat += event.zero_variance_groups
        self.counters.staleness.update(event.staleness)
        self.counters.token_age_sum += event.token_ages[0]
        self.counters.trained_tokens += event.token_ages[1]

    def _collapsed(self, event: Collapsed) -> None:
        self.collapsed = True

    def _eval_started(self, event: EvalStarted) -> None:
        self.counters.evals_started += 1

    def _eval_ended(self, event: EvalEnded) -> None:
        self.counters.evals_ended += 1
        if event.completed:
            self.counters.evals_finished += 1

    def _stalled(self, event: Stalled) -> None:
        if event.report.repeat == 1:
            self.counters.stalls += 1


class FateRecord:
    """Records each scenario's fate once: resolves it, lets it leave the queue, emits it."""

    def __init__(
        self,
        *,
        ledger: ScenarioBook,
        gate: _Discards,
        observers: Observers,
    ) -> None:
        self._ledger = ledger
        self._gate = gate
        self._observers = observers

    def settle(
        self, fate: Fate, index: int, *, rollout_s: float = 0.0, queued: bool = False
    ) -> None:
        """Scenario `index` ended as `fate` after `rollout_s` seconds of rollout.

        `queued`: its group had been handed to the trainer (it leaves the gate's queue).
        """
        if fate in RESOLVED_AT_ONCE:
            self._ledger.resolve(index)
        if queued and fate is not Fate.TRAINED:
            self._gate.group_discarded(scored_alike=fate is Fate.ZERO_VARIANCE)
        self._observers.emit(ScenarioSettled(index, fate, rollout_s, queued))

    def settle_many(
        self, fate: Fate, entries: Iterable[tuple[int, float]], *, queued: bool = False
    ) -> None:
        """Settle each (scenario index, rollout seconds) as `fate` (a user observer raising
        on one never stops the rest: `Observers.emit` keeps its error for the end of the run)."""
        for index, seconds in entries:
            self.settle(fate, index, rollout_s=seconds, queued=queued)

    def settle_trained(self, indices: Iterable[int], rollout_seconds: Iterable[float]) -> None:
        """A batch was trained (its scenarios are resolved with its step by the ledger)."""
        self.settle_many(Fate.TRAINED, zip(indices, rollout_seconds, strict=True))
