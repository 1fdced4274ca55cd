"""The trainer's settings, each declared once: name, type, default, doc and check.

The settings come in seven groups (`Sizes`, `FreshnessSettings`, `Training`, `Evaluation`,
`Persistence`, `Status`, `Shutdown`), joined in `PipelineSettings`. Everything else that
lists settings is derived from the declarations below: the flat keyword view of
`PipelineTrainer(...)` (see art_trio.config.keywords), the trainer's attribute proxy
(`trainer.max_batch_size`), `resize`'s names (the `Sizes` group) and the value checks.

Every ValueError the reference raises for a bad constructor value is raised here, with the
same message. Checks run group by group in the order declared (the runtime sizes first, as
ART 0.5.20+'s `PipelineRuntimeConfig` checks them), in three passes: values that are not
numbers at all, then the range checks, then whole-number and finiteness checks (so a number
the reference's checks refuse gets the reference's text).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from ..plumbing.compat import check_line_supports
from ..policy.admission import AdmissionPolicy
from ..policy.batching import Freshness
from ..policy.retention import CheckpointRetentionStrategy
from ..policy.rules import Rule, above, at_least, count_error, not_a_number, not_finite, one_of

StallAction = Literal["log", "raise", "stop"]
#: The `admission=` modes by name (`facade/compose.py` builds each); or a policy object.
Admission = Literal["staleness_aware", "eager"]
ADMISSION_MODES: tuple[Admission, ...] = get_args(Admission)


#: What an admission policy object must have (`art_trio.AdmissionPolicy`).
ADMISSION_METHODS = ("headroom", "lookahead", "take_batch")
ADMISSION_ATTRIBUTES = ("cancels_doomed_rollouts", "drops_stale_early", "gate_class")


def _admission_ok(value: object) -> bool:
    if isinstance(value, str):
        return value in ADMISSION_MODES
    return all(callable(getattr(value, m, None)) for m in ADMISSION_METHODS) and all(
        hasattr(value, a) for a in ADMISSION_ATTRIBUTES
    )


STALL_ACTIONS: tuple[StallAction, ...] = get_args(StallAction)

STALL_FLOOR_SECONDS = 600.0
"""`stall_seconds="auto"`: never less than this (and this until the run has measured more).

Ten minutes: longer than any step, rollout or eval of a run that has measured none yet is
likely to take, short enough that a hung run (ART issues 315, 346, 395, 656) is named while
someone still watches it.
"""

STALL_MULTIPLE = 10.0
"""`stall_seconds="auto"`: this many times the longest of the median rollout time, the step
period and the longest backend or callback call measured so far (when above the floor)."""


def _stall_seconds_ok(value: object) -> bool:
    return value == "auto" or (
        isinstance(value, numbers.Real) and not isinstance(value, bool)
        and math.isfinite(value) and float(value) > 0
    )


DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0
"""How long a stop lets in-flight rollouts and a running eval finish before cancelling them.

Long enough for an agent's tool calls to return and clean up, short enough that Ctrl-C
never feels like a hang. `None` waits as long as they take, as ART's trainer does.
"""

DEFAULT_MAX_CONSECUTIVE_ROLLOUT_FAILURES = 100
"""Rollouts failing in a row (no success between) after which the run stops with an error.

A rollout that fails now and then is counted and skipped; a hundred in a row means the
rollout code or the server it calls is broken, and going on would only mark the whole source
as errored while printing failure lines forever.
"""


# -- how a setting is declared ----------------------------------------------------------


Number = Literal["count", "real", "finite"]


def setting(
    default: Any, doc: str, *, rule: Rule | None = None, number: Number | None = None
) -> Any:
    """Declare one setting (a dataclass field of its group).

    `number`: "count" for a whole number (an int, not a bool), "real" for any real number,
    "finite" for a finite one; None for values art_trio passes on unchecked (a loss name,
    a learning rate: ART's backends judge them). Whether None is allowed comes from the
    field's type.
    """
    return field(default=default, metadata={"doc": doc, "rule": rule, "number": number})


# -- the groups ---------------------------------------------------------------------------


def default_max_batch_size(min_batch_size: Any) -> Any:
    """ART's rule for an unset `max_batch_size`: 10 x `min_batch_size` (the flat keywords
    and `Sizes(...)` both use it). A value that is no number is left for the checks."""
    if isinstance(min_batch_size, bool) or not isinstance(min_batch_size, (int, float)):
        return None
    return 10 * max(min_batch_size, 1)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How many rollouts run and how many groups a batch takes (ART 0.5.20+'s
    `PipelineRuntimeConfig`); the settings `resize()` changes while a run goes."""

    num_rollout_workers: int = setting(
        16, "Rollouts running at once.", rule=above(0), number="count")
    min_batch_size: int = setting(
        4, "Groups a batch waits for.", rule=above(0), number="count")
    max_batch_size: int = setting(
        None, "Most groups in a batch (unset: 10 x min_batch_size, ART's rule, whichever "
        "way the sizes are given).", rule=above(0), number="count")
    queue_maxsize: int | None = setting(
        None, "Capacity of the groups channel (None: max_batch_size x the staleness window).",
        rule=above(0), number="count")

    def __post_init__(self) -> None:
        if self.max_batch_size is None:
            object.__setattr__(self, "max_batch_size", default_max_batch_size(self.min_batch_size))

    def problems(self) -> list[str]:
        if self.max_batch_size < self.min_batch_size:
            return ["max_batch_size must be >= min_batch_size"]
        return []


@dataclass(frozen=True, slots=True)
class FreshnessSettings:
    """How old a group may be when it trains, and how rollouts are admitted against that."""

    max_steps_off_policy: int | None = setting(
        4, "The hard bound on a group's age in steps (None: off, ART 0.5.20+).",
        rule=at_least(0), number="count")
    limit_mean_steps_off_policy: float | None = setting(
        None, "ART 0.5.20's bound on a group's token-weighted mean policy age (None: off).",
        rule=at_least(0), number="finite")
    admission: Admission | AdmissionPolicy = setting(
        "staleness_aware", "'staleness_aware' starts a rollout only if a batch still to come "
        "can train it; 'eager' is the reference's gate exactly; or a policy of your own (an "
        "`AdmissionPolicy`).",
        rule=Rule(_admission_ok, f"one of {', '.join(map(repr, ADMISSION_MODES))} or an "
                  f"AdmissionPolicy (methods {', '.join(ADMISSION_METHODS)}; attributes "
                  f"{', '.join(ADMISSION_ATTRIBUTES)})"))
    max_rollouts_beyond_bound: int | None = setting(
        None, "Rollouts 'staleness_aware' admits past its bound, trading wasted rollouts for "
        "trainer utilization (None: max_batch_size / 8).",
        rule=at_least(0, " (or None for max_batch_size / 8)"), number="count")

    @property
    def rule(self) -> Freshness:
        """The staleness bounds, as one rule (see batching.Freshness)."""
        return Freshness(self.max_steps_off_policy, self.limit_mean_steps_off_policy)


@dataclass(frozen=True, slots=True)
class Training:
    """What each `backend.train` call is given (ART's training keyword arguments)."""

    learning_rate: float = setting(1e-5, "The optimizer's learning rate.")
    loss_fn: str = setting("cispo", "ART's loss function name.")
    loss_fn_config: dict[str, Any] | None = setting(None, "The loss function's options.")
    normalize_advantages: bool = setting(True, "Normalize advantages within a group.")
    adam_params: object | None = setting(None, "Adam's parameters, as ART takes them.")
    kl_penalty_coef: float = setting(0.0, "The KL penalty's weight (0: no penalty).")
    kl_penalty_reference_step: int | None = setting(
        None, "The step the KL penalty measures against.", number="count")
    kl_penalty_step_lag: int | None = setting(
        None, "Or: how many steps behind the current one that reference is (ART 0.5.20+).",
        rule=at_least(1), number="count")
    grad_accumulation_sequences: int | None = setting(
        None, "Sequences per gradient accumulation (ART 0.5.20+).",
        rule=at_least(1), number="count")
    packed_sequence_length: int | None = setting(
        None, "Packed sequence length (ART 0.5.18).",
        rule=above(0, " (or None to leave it unset)"), number="count")
    optimizer_save_interval: int = setting(
        5, "Steps between optimizer state saves (ART 0.5.20+).", rule=above(0), number="count")


@dataclass(frozen=True, slots=True)
class Evaluation:
    """When `eval_fn` runs."""

    eval_every_n_steps: int = setting(
        20, "Steps between evals (0: none after the start).", rule=at_least(0), number="count")
    eval_at_start: bool = setting(True, "Eval the starting policy (ART 0.5.18: eval_step_0).")


@dataclass(frozen=True, slots=True)
class Persistence:
    """What a run keeps on disk: checkpoints and the resume record."""

    save_checkpoint: bool = setting(True, "Save a checkpoint at each step.")
    checkpoint_retention_strategy: CheckpointRetentionStrategy | None = setting(
        None, "Which checkpoints to keep (None: the backend's own rule).")
    checkpoint_retention_interval: int = setting(
        1, "Steps between retention passes.", rule=above(0), number="count")
    resume: bool = setting(True, "Continue from the model directory's resume record.")
    fsync_state: bool = setting(
        False, "Also make each step's resume record durable against power loss or an OS "
        "crash, not only against the process dying (off by default: a disk sync per step "
        "costs 0.5-5 ms on a plain SSD, more than the rest of a step's overhead).")


@dataclass(frozen=True, slots=True)
class Status:
    """The status line and the progress it reports."""

    log_interval_seconds: float = setting(
        60.0, "Seconds between status lines.", rule=above(0), number="real")
    status_ewa_alpha: float = setting(
        0.2, "Smoothing of the status line's rates.",
        rule=Rule(lambda v: 0 < v <= 1, "in (0, 1]"), number="real")
    total_scenarios: int | None = setting(
        None, "Scenarios in the source, for the progress shown.", rule=at_least(0),
        number="count")
    stall_seconds: float | Literal["auto"] | None = setting(
        "auto", "Seconds without a rollout ending, a step training or an eval ending after "
        "which the run is reported stalled (where each stage waits, the calls and rollouts "
        "in flight, the task tree), again while it persists; also how long the event loop "
        "may not answer (wall seconds) before it is reported blocked. 'auto': 10 x the "
        "longest of the median rollout time, the step period and the longest call "
        "measured, at least 600 s; None: no watchdog.",
        rule=Rule(_stall_seconds_ok, "'auto', None (off) or a finite number of seconds > 0"))
    stall_action: StallAction = setting(
        "log", "What a stall report does besides being reported (a log record, the Stalled "
        "event, the status line): 'log' nothing more, 'raise' ends the run with "
        "PipelineStalled (state saved, a retry resumes), 'stop' stops it as request_stop() "
        "does.", rule=one_of(STALL_ACTIONS))


@dataclass(frozen=True, slots=True)
class Shutdown:
    """When a run ends, and how long its end may take."""

    max_steps: int | None = setting(
        None, "Steps to train (None: until the scenarios end).", rule=at_least(0),
        number="count")
    discard_queue_multiplier: int = setting(
        100, "Held zero-variance groups, per min_batch_size, at which training stops as "
        "collapsed.", rule=above(0), number="count")
    max_consecutive_rollout_failures: int | None = setting(
        DEFAULT_MAX_CONSECUTIVE_ROLLOUT_FAILURES,
        "Rollouts failing in a row after which the run stops with an error (None: never). "
        "Those scenarios stay unresolved, so a resumed run rolls them again once the cause "
        "is fixed.",
        rule=above(0, " (or None to never stop on failures)"), number="count")
    shutdown_grace_seconds: float | None = setting(
        DEFAULT_SHUTDOWN_GRACE_SECONDS,
        "After a stop, how long in-flight rollouts and an eval may take before they are "
        "cancelled (None: as long as they take).",
        rule=at_least(0, " (or None to wait for in-flight work however long it takes)"),
        number="real")


# -- all of them --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """What `PipelineTrainer(...)` was configured with, after defaults are resolved.

    Read a setting through its group (`settings.sizes.max_batch_size`); `replace()` and
    `from_flat()` take the flat names ART's keyword arguments use.
    """

    sizes: Sizes = field(default_factory=Sizes)
    freshness: FreshnessSettings = field(default_factory=FreshnessSettings)
    training: Training = field(default_factory=Training)
    evaluation: Evaluation = field(default_factory=Evaluation)
    persistence: Persistence = field(default_factory=Persistence)
    status: Status = field(default_factory=Status)
    shutdown: Shutdown = field(default_factory=Shutdown)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> PipelineSettings:
        """Settings from flat names (`max_batch_size=...`), the rest at their defaults."""
        return cls().replace(**values)

    def replace(self, **changes: Any) -> PipelineSettings:
        """A copy with the named settings changed (flat names), validated (ValueError)."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown setting {unknown[0]!r}; the settings are {sorted(FIELDS)}")
        groups: dict[str, Any] = {}
        for group in GROUPS:
            mine = {n: v for n, v in changes.items() if FIELDS[n] == group}
            current = getattr(self, group)
            groups[group] = type(current)(**{**_values(current), **mine}) if mine else current
        return PipelineSettings(**groups)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, in declaration order."""
        return {n: v for group in GROUPS for n, v in _values(getattr(self, group)).items()}

    def get(self, name: str) -> Any:
        """One setting by its flat name (KeyError if there is none)."""
        return getattr(getattr(self, FIELDS[name]), name)

    @property
    def groups_capacity(self) -> int:
        """Capacity of the channel from rollout workers to the trainer (as the reference)."""
        if self.sizes.queue_maxsize is not None:
            return self.sizes.queue_maxsize
        return max(1, self.freshness.rule.queue_window * self.sizes.max_batch_size)

    @property
    def discard_limit(self) -> int:
        """Held zero-variance groups at which training stops as collapsed."""
        return self.shutdown.discard_queue_multiplier * self.sizes.min_batch_size

    @property
    def rollouts_beyond_bound(self) -> int:
        """The staleness-aware gate's slack: rollouts it admits past its bound.

        One per 8 groups of a batch by default. The bound already counts on some rollouts
        missing their window (see gate.py); the slack covers the luck of a single batch.
        Measured with `art-trio bench` on the issue's plenty-off1 workload: slack 0 gives
        utilization 0.956 with 4.5% wasted rollouts, 1 gives 0.974 / 8.5%, 4 gives 0.980 / 17%.
        The gate admits less of it when rollouts end close together (see gate.py).
        """
        if self.freshness.max_rollouts_beyond_bound is not None:
            return self.freshness.max_rollouts_beyond_bound
        return max(1, math.ceil(self.sizes.max_batch_size / 8))


def _values(group: object) -> dict[str, Any]:
    return {f.name: getattr(group, f.name) for f in fields(group)}  # type: ignore[arg-type]


#: The groups' attribute names on PipelineSettings, in declaration order.
GROUPS: tuple[str, ...] = tuple(f.name for f in fields(PipelineSettings))
#: The group classes, by attribute name.
GROUP_TYPES: dict[str, type] = {
    f.name: f.default_factory for f in fields(PipelineSettings)  # type: ignore[misc]
}
#: Every setting's flat name -> the group that declares it.
FIELDS: dict[str, str] = {}
#: Every setting's declaration (a dataclass Field: type, default, doc, rule, number).
DECLARATIONS: dict[str, Any] = {}
for _group in GROUPS:
    for _field in fields(GROUP_TYPES[_group]):
        if _field.name in FIELDS or _field.name in GROUPS:
            raise TypeError(f"setting {_field.name!r} is declared twice")
        FIELDS[_field.name] = _group
        DECLARATIONS[_field.name] = _field


def optional(name: str) -> bool:
    """Whether the setting's type allows None."""
    return "None" in str(DECLARATIONS[name].type)


# -- the checks ---------------------------------------------------------------------------


def _problems(settings: PipelineSettings) -> Iterator[str | None]:
    """Each check's verdict in order (None: passed): not-a-number values, then ranges (with
    each group's own cross checks after its fields'), then whole numbers and finiteness."""
    values = settings.flat()
    for name, value in values.items():
        if DECLARATIONS[name].metadata["number"] is not None:
            yield not_a_number(name, value, optional(name))
    for group in GROUPS:
        part = getattr(settings, group)
        for name, value in _values(part).items():
            rule: Rule | None = DECLARATIONS[name].metadata["rule"]
            if rule is not None and not (value is None and optional(name)):
                yield rule.problem(name, value)
        yield from getattr(part, "problems", list)()
    for name, value in values.items():
        number = DECLARATIONS[name].metadata["number"]
        if number == "count":
            yield count_error(name, value, optional=optional(name))
        elif number == "finite":
            yield not_finite(name, value)


def validate(settings: PipelineSettings) -> None:
    """Raise the first problem's ValueError (in `_problems`' order)."""
    problem = next(filter(None, _problems(settings)), None)
    if problem is not None:
        raise ValueError(problem)
    check_line_supports(
        grad_accumulation_sequences=settings.training.grad_accumulation_sequences
    )
