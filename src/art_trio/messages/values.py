"""The run's plain messages: data the layers above pass around, knowing nothing of a run.

The bottom layer. `Delivered` travels from a rollout worker to the trainer, `Fate` says how a
scenario ended, `TallyBase` is what the persisted tallies held when a run began, `RolloutInFlight`
and `CallInFlight` what a run awaits at a moment (for the stall watchdog). Frozen or
plain data with no behaviour of their own; everything else (the policy modules, the stages,
the facade) imports these, and they import nothing of art_trio. The events a run emits and
`RunStatistics` (events.py) belong to this layer too, and `cheap_init`, the quick `__init__`
the hot path's frozen dataclasses share.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from art import TrajectoryGroup

_D = TypeVar("_D")


def cheap_init(cls: type[_D]) -> type[_D]:
    """Give a frozen slotted dataclass an `__init__` that sets its slots through their
    descriptors: a frozen dataclass's own goes through `object.__setattr__` per field (about
    1.5 us for two fields on CPython 3.11, against 0.7 us this way). Events are built on
    every rollout and the gate's snapshots on every admission decision: the hot path. The
    instance stays frozen to everyone else. A subclass's inherited fields are set through
    the slots of the class that declares them."""
    namespace: dict[str, Any] = {}
    params, body = [], []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        slot = next(k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__)
        namespace[f"_set_{f.name}"] = slot.__set__
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(source, namespace)  # noqa: S102 (built from the dataclass's own field names)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


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


@dataclass(frozen=True, slots=True)
class RolloutInFlight:
    """A rollout running at the moment it was read (for the stall watchdog's report)."""

    scenario_index: int
    #: Seconds since it started (the loop's clock).
    age_s: float
    worker: int


@dataclass(frozen=True, slots=True)
class CallInFlight:
    """A call a stage is awaiting: `backend.train`, `model.log`, a checkpoint hook, the
    `eval_fn`, or a phase such as collecting a batch."""

    stage: str
    call: str
    #: Seconds since it began.
    age_s: float
