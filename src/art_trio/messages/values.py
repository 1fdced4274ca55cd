"""The run's plain messages: data the layers above pass around, knowing nothing of a run.

The bottom layer. `Delivered` travels from a rollout worker to the trainer, `Fate` says how a
scenario ended, `TallyBase` is what the persisted tallies held when a run began. Frozen or
plain data with no behaviour of their own; everything else (the policy modules, the stages,
the facade) imports these, and they import nothing of art_trio. The events a run emits and
`RunStatistics` (events.py) belong to this layer too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from art import TrajectoryGroup


@dataclass(slots=True)
class Delivered:
    """A group on its way from a rollout worker to the trainer, with where it came from."""

    group: TrajectoryGroup
    scenario_index: int
    rollout_wall_s: float
    actor_idle_s: float
    #: The group's `initial_policy_version` (oldest of its trajectories), None if unversioned.
    version: int | None = None
    #: Its tokens' mean policy version, token-weighted (only with a mean-age bound set).
    mean_version: float | None = None
    #: Its tokens per policy version (`freshness.plain_tokens`), read once as it was handed
    #: over where that reading is plain; None: the trained step reads them off the group.
    tokens: dict[int, float] | None = None


class Fate(enum.Enum):
    """How a scenario taken from the source ended."""

    #: Its group was in a batch `backend.train` trained.
    TRAINED = "trained"
    #: Its group completed but was too old for every batch still to come.
    STALE = "stale"
    #: Its rollout was cancelled by the gate before it completed: no batch still to come
    #: could train it (doomed). Counted in `stale` too, as ART counts it.
    CANCELLED_STALE = "cancelled_stale"
    #: Every trajectory of its group scored the same: nothing to learn from.
    ZERO_VARIANCE = "zero_variance"
    #: Its rollout raised or returned something untrainable.
    ERRORED = "errored"
    #: In flight, queued or ready when the run stopped, or in a `backend.train` call that
    #: ended without a result (a forced stop, an error): unresolved here. A resumed run rolls
    #: it again, except a batch the backend's step shows was trained (see the ledger).
    DROPPED_AT_STOP = "dropped_at_stop"


#: Fates after which a resumed run never rolls the scenario again, resolved as they happen.
#: (TRAINED is resolved with its batch's step, ERRORED once a later rollout succeeds: see
#: the ledger and the rollout stage.)
RESOLVED_AT_ONCE = frozenset({Fate.STALE, Fate.CANCELLED_STALE, Fate.ZERO_VARIANCE})


class TallyBase(NamedTuple):
    """ART 0.5.20's persisted tallies at the start of a run (groups, not rollouts)."""

    accepted: int
    stale: int
    zero_variance: int
