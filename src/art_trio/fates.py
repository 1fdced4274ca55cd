"""Where each scenario ends up: one closed set of fates, recorded once per scenario.

A scenario taken from the source ends exactly once, as one `Fate`, through
`FateRecord.settle`. Everything that counts fates follows from that one call: the run's
`RunCounters`, the status line, the resume ledger (which scenarios never roll again), the
gate's queue bookkeeping and the run's observers (`trainer.add_observer`). No stage counts a
fate by hand, so the counters cannot drift from the ledger.

A rollout lost with its executor worker is not a fate: its scenario goes back to the source
and is taken again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .events import Observers, ScenarioSettled
from .messages import RESOLVED_AT_ONCE, Fate

if TYPE_CHECKING:
    from .gate import PolicyGate
    from .ledger import ScenarioLedger
    from .status import StatusReporter


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
    errored: int = 0
    dropped_at_stop: int = 0
    rollouts_started: int = 0
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
    #: inside `backend.train`.
    train_s: float = 0.0
    staleness: Counter[int] = field(default_factory=Counter)
    """Trained groups by how many versions behind the policy they were trained from.

    A histogram, not a list per group, so a run of a million groups costs no more memory."""


class FateRecord:
    """Records each scenario's fate once and tells everyone who follows fates."""

    def __init__(
        self,
        counters: RunCounters,
        *,
        ledger: ScenarioLedger,
        status: StatusReporter,
        gate: PolicyGate,
        observers: Observers,
    ) -> None:
        self.counters = counters
        self._ledger = ledger
        self._status = status
        self._gate = gate
        self._observers = observers

    def settle(
        self, fate: Fate, index: int, *, rollout_s: float = 0.0, queued: bool = False
    ) -> None:
        """Scenario `index` ended as `fate` after `rollout_s` seconds of rollout.

        `queued`: its group had been handed to the trainer (it leaves the gate's queue).
        """
        c = self.counters
        if fate is Fate.TRAINED:
            c.trained += 1
        elif fate is Fate.STALE:
            c.stale += 1
            c.stale_rollout_s += rollout_s
            self._status.note_stale(1)
        elif fate is Fate.CANCELLED_STALE:
            c.stale += 1
            c.stale_cancelled += 1
            c.cancelled_rollout_s += rollout_s
            self._status.note_stale(1)
        elif fate is Fate.ZERO_VARIANCE:
            c.zero_variance += 1
            self._status.note_zero_variance_discarded(1)
        elif fate is Fate.ERRORED:
            c.errored += 1
            self._status.errored += 1
        else:
            c.dropped_at_stop += 1
        if fate in RESOLVED_AT_ONCE:
            self._ledger.resolve(index)
        if queued and fate is not Fate.TRAINED:
            self._gate.group_discarded()
        emit = self._observers.emit  # None while nobody observes: nothing is built
        if emit is not None:
            emit(ScenarioSettled(index, fate, rollout_s, queued))

    def settle_many(
        self, fate: Fate, entries: Iterable[tuple[int, float]], *, queued: bool = False
    ) -> None:
        """Settle each (scenario index, rollout seconds) as `fate`, every one of them even if
        an observer raises on one (its first error is raised after the last is settled):
        otherwise the rest of a batch would end in no fate at all."""
        first: Exception | None = None
        for index, seconds in entries:
            try:
                self.settle(fate, index, rollout_s=seconds, queued=queued)
            except Exception as exc:  # an observer's: counted and recorded already
                first = first or exc
        if first is not None:
            raise first

    def settle_trained(self, indices: Iterable[int], rollout_seconds: Iterable[float]) -> None:
        """A batch was trained (its scenarios are resolved with its step by the ledger)."""
        self.settle_many(Fate.TRAINED, zip(indices, rollout_seconds, strict=True))


__all__ = ["Fate", "FateRecord", "RESOLVED_AT_ONCE", "RunCounters"]
