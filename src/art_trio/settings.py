"""The trainer's validated parameters.

Every ValueError the reference raises for a bad constructor value is raised here, with the
same message, in the same order, so code that catches them keeps working. New parameters
validate the same way: the message names the parameter and the range it accepts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .batching import Freshness
from .compat import check_line_supports
from .retention import CheckpointRetentionStrategy

Admission = Literal["staleness_aware", "eager"]
ADMISSION_MODES: tuple[Admission, ...] = ("staleness_aware", "eager")

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


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """What `PipelineTrainer(...)` was configured with, after defaults are resolved."""

    num_rollout_workers: int = 16
    min_batch_size: int = 4
    max_batch_size: int = 40
    #: The hard bound on a group's age (None: off, ART 0.5.20+).
    max_steps_off_policy: int | None = 4
    #: ART 0.5.20's bound on a group's token-weighted mean policy age (None: off).
    limit_mean_steps_off_policy: float | None = None
    queue_maxsize: int | None = None
    learning_rate: float = 1e-5
    loss_fn: str = "cispo"
    loss_fn_config: dict[str, Any] | None = None
    normalize_advantages: bool = True
    adam_params: object | None = None
    kl_penalty_coef: float = 0.0
    kl_penalty_reference_step: int | None = None
    kl_penalty_step_lag: int | None = None
    grad_accumulation_sequences: int | None = None
    optimizer_save_interval: int = 5
    packed_sequence_length: int | None = None
    max_steps: int | None = None
    discard_queue_multiplier: int = 100
    log_interval_seconds: float = 60.0
    status_ewa_alpha: float = 0.2
    total_scenarios: int | None = None
    eval_every_n_steps: int = 20
    eval_at_start: bool = True
    save_checkpoint: bool = True
    checkpoint_retention_strategy: CheckpointRetentionStrategy | None = None
    checkpoint_retention_interval: int = 1
    resume: bool = True
    shutdown_grace_seconds: float | None = DEFAULT_SHUTDOWN_GRACE_SECONDS
    admission: Admission = "staleness_aware"
    max_rollouts_beyond_bound: int | None = None
    fsync_state: bool = False
    max_consecutive_rollout_failures: int | None = DEFAULT_MAX_CONSECUTIVE_ROLLOUT_FAILURES

    def __post_init__(self) -> None:
        validate(self)

    @property
    def freshness(self) -> Freshness:
        """The staleness bounds, as one rule (see batching.Freshness)."""
        return Freshness(self.max_steps_off_policy, self.limit_mean_steps_off_policy)

    @property
    def groups_capacity(self) -> int:
        """Capacity of the channel from rollout workers to the trainer (as the reference)."""
        if self.queue_maxsize is not None:
            return self.queue_maxsize
        return max(1, self.freshness.queue_window * self.max_batch_size)

    @property
    def discard_limit(self) -> int:
        """Held zero-variance groups at which training stops as collapsed."""
        return self.discard_queue_multiplier * self.min_batch_size

    @property
    def rollouts_beyond_bound(self) -> int:
        """The staleness-aware gate's slack: rollouts it admits past its bound.

        One per 8 groups of a batch by default. The bound already counts on some rollouts
        missing their window (see gate.py); the slack covers the luck of a single batch.
        Measured with `art-trio bench` on the issue's plenty-off1 workload: slack 0 gives
        utilization 0.956 with 4.5% wasted rollouts, 1 gives 0.974 / 8.5%, 4 gives 0.980 / 17%.
        The gate admits less of it when rollouts end close together (see gate.py).
        """
        if self.max_rollouts_beyond_bound is not None:
            return self.max_rollouts_beyond_bound
        return max(1, math.ceil(self.max_batch_size / 8))


def resolve_runtime(
    pipeline: Any | None, autotune: Any | None, direct: dict[str, int | None]
) -> dict[str, int | None]:
    """The four runtime settings, from `pipeline=PipelineRuntimeConfig(...)` or the direct kwargs.

    ART 0.5.20 moved them into a config object and kept the keyword arguments as aliases;
    both spellings work here on every ART line (the trainer warns about the aliases as the
    installed ART does, see compat.deprecate_direct_runtime), and giving both is ART's
    ValueError.
    """
    given = {name: value for name, value in direct.items() if value is not None}
    mode = getattr(autotune, "mode", "off") if autotune is not None else "off"
    if mode != "off":
        if pipeline is not None or given:
            raise ValueError(
                "Pipeline runtime config cannot be provided when pipeline autotuning is "
                "enabled. The autotuner owns the initial and online pipeline settings."
            )
        # The autotuner's starting point (a saved profile, if asked for, is read by the
        # trainer, which knows the model's directory).
        from .autotune import initial_runtime

        return initial_runtime(autotune)
    if pipeline is not None and given:
        raise ValueError(
            "Use either pipeline=PipelineRuntimeConfig(...) or deprecated direct pipeline "
            "settings, not both."
        )
    if pipeline is not None:
        return {name: getattr(pipeline, name) for name in direct}
    return {**RUNTIME_DEFAULTS, **given}


#: The runtime settings' defaults when neither `pipeline=` nor a direct kwarg sets them.
RUNTIME_DEFAULTS: dict[str, int | None] = {
    "num_rollout_workers": 16,
    "min_batch_size": 4,
    "max_batch_size": None,
    "queue_maxsize": None,
}


def _positive(name: str) -> Check:
    return (lambda s: getattr(s, name) > 0, f"{name} must be > 0")


def _at_least(name: str, low: float, suffix: str = "") -> Check:
    return (
        lambda s: getattr(s, name) is None or getattr(s, name) >= low,
        f"{name} must be >= {low:g}{suffix}",
    )


Check = tuple[Callable[["PipelineSettings"], bool], str]

#: Every value check, in the reference's order and with its messages first (code that catches
#: them keeps working), then ART 0.5.18's and 0.5.20's additions, then art_trio's own.
CHECKS: tuple[Check, ...] = (
    _positive("num_rollout_workers"),
    _positive("min_batch_size"),
    _positive("max_batch_size"),
    (lambda s: s.max_batch_size >= s.min_batch_size, "max_batch_size must be >= min_batch_size"),
    _at_least("max_steps_off_policy", 0),
    (
        lambda s: s.limit_mean_steps_off_policy is None or s.limit_mean_steps_off_policy >= 0,
        "limit_mean_steps_off_policy must be >= 0",
    ),
    (lambda s: s.queue_maxsize is None or s.queue_maxsize > 0, "queue_maxsize must be > 0"),
    _at_least("eval_every_n_steps", 0),
    _at_least("max_steps", 0),
    _positive("log_interval_seconds"),
    _positive("discard_queue_multiplier"),
    (lambda s: 0 < s.status_ewa_alpha <= 1, "status_ewa_alpha must be in (0, 1]"),
    _at_least("total_scenarios", 0),
    _positive("checkpoint_retention_interval"),
    (
        lambda s: s.packed_sequence_length is None or s.packed_sequence_length > 0,
        "packed_sequence_length must be > 0 (or None to leave it unset)",
    ),
    _positive("optimizer_save_interval"),
    _at_least("kl_penalty_step_lag", 1),
    _at_least("grad_accumulation_sequences", 1),
    (
        lambda s: s.shutdown_grace_seconds is None or s.shutdown_grace_seconds >= 0,
        "shutdown_grace_seconds must be >= 0 (or None to wait for in-flight work however "
        "long it takes)",
    ),
    (
        lambda s: s.admission in ADMISSION_MODES,
        f"admission must be one of {', '.join(map(repr, ADMISSION_MODES))}",
    ),
    (
        lambda s: s.max_consecutive_rollout_failures is None
        or s.max_consecutive_rollout_failures > 0,
        "max_consecutive_rollout_failures must be > 0 (or None to never stop on failures)",
    ),
    (
        lambda s: s.max_rollouts_beyond_bound is None or s.max_rollouts_beyond_bound >= 0,
        "max_rollouts_beyond_bound must be >= 0 (or None for max_batch_size / 8)",
    ),
)


#: Settings that count or size something: whole numbers (`int`, not `bool`), `True` where
#: None is allowed. A float count used to get through the checks above and break the run
#: later (`num_rollout_workers=inf` started workers forever, `max_batch_size=inf` ended
#: the run with a TypeError, 2.5 workers were accepted).
COUNTS: dict[str, bool] = {
    "num_rollout_workers": False,
    "min_batch_size": False,
    "max_batch_size": False,
    "max_steps_off_policy": True,
    "queue_maxsize": True,
    "kl_penalty_reference_step": True,
    "kl_penalty_step_lag": True,
    "grad_accumulation_sequences": True,
    "optimizer_save_interval": False,
    "packed_sequence_length": True,
    "max_steps": True,
    "discard_queue_multiplier": False,
    "total_scenarios": True,
    "eval_every_n_steps": False,
    "checkpoint_retention_interval": False,
    "max_rollouts_beyond_bound": True,
    "max_consecutive_rollout_failures": True,
}

#: Settings that are real numbers (None allowed for all of them but the interval).
REALS: dict[str, bool] = {
    "limit_mean_steps_off_policy": True,
    "log_interval_seconds": False,
    "status_ewa_alpha": False,
    "shutdown_grace_seconds": True,
}


def count_error(name: str, value: object, *, optional: bool) -> str | None:
    """Why `value` cannot be the count `name`, else None."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return None
    what = "a whole number (an int)" + (" or None" if optional else "")
    return f"{name} must be {what}, got {value!r}"


def _not_a_number(name: str, value: object, optional: bool) -> str | None:
    """Checked before the reference's value checks, which would fail with a bare TypeError
    comparing a string (or None) to a number."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real):
        return None
    what = "a number" + (" or None" if optional else "")
    return f"{name} must be {what}, got {value!r} ({type(value).__name__})"


def validate(settings: PipelineSettings) -> None:
    """Raise the first failing check's ValueError (see CHECKS), then the type checks'.

    Values that are not numbers at all are refused first (the reference's checks would raise
    a bare TypeError on them); numbers its checks accept but no count can be (2.5, inf,
    True) after them, so every ValueError the reference raises keeps its text.
    """
    for name, optional in (COUNTS | REALS).items():
        problem = _not_a_number(name, getattr(settings, name), optional)
        if problem is not None:
            raise ValueError(problem)
    for check, message in CHECKS:
        if not check(settings):
            if message.startswith("admission "):
                message = f"{message}, got {settings.admission!r}"
            raise ValueError(message)
    for name, optional in COUNTS.items():
        problem = count_error(name, getattr(settings, name), optional=optional)
        if problem is not None:
            raise ValueError(problem)
    limit = settings.limit_mean_steps_off_policy
    if limit is not None and (isinstance(limit, bool) or not math.isfinite(limit)):
        # ART 0.5.23 accepts inf and then fails sizing its queue (math.ceil(inf)); None is
        # the one spelling of "no mean-age bound" on every line.
        raise ValueError(
            f"limit_mean_steps_off_policy must be a finite number of steps, got {limit!r}; "
            "pass None for no mean policy-age bound"
        )
    check_line_supports(grad_accumulation_sequences=settings.grad_accumulation_sequences)


def build_settings(
    *,
    max_batch_size: int | None,
    eval_step_0: bool,
    eval_at_start: bool | None,
    **values: Any,
) -> PipelineSettings:
    """The constructor's values with their aliases and derived defaults resolved, validated
    (ValueError on a bad value; see CHECKS)."""
    min_batch_size = values["min_batch_size"]
    settings = PipelineSettings(
        # The reference checks a given max_batch_size before defaulting it (CHECKS' order).
        max_batch_size=(
            max_batch_size if max_batch_size is not None else 10 * max(min_batch_size, 1)
        ),
        eval_at_start=eval_step_0 if eval_at_start is None else eval_at_start,
        **values,
    )
    # `eval_step_0` keeps its reference default (True), so only an explicit False can be told
    # apart from the default: that, against eval_at_start=True, is a contradiction.
    if eval_at_start is not None and not eval_step_0 and eval_at_start:
        raise ValueError(
            "eval_at_start and eval_step_0 disagree (eval_at_start is the newer name of "
            "eval_step_0): pass only one of them"
        )
    return settings
