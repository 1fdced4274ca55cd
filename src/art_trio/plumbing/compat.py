"""The one module that knows how ART's release lines differ.

art_trio runs on two lines of `openpipe-art`, each the newest its Python allows:

- 0.5.17-0.5.18 (Python 3.11): direct pipeline keyword arguments, `eval_step_0` /
  `eval_at_start`, `packed_sequence_length`, `adapter_lease` for rollouts and evals.
- 0.5.20-0.5.23 (Python 3.12+): `TrainableModel(run_name=...)` is required,
  `pipeline=PipelineRuntimeConfig(...)`, `optimizer_save_interval` and
  `grad_accumulation_sequences` reach `backend.train`, the KL reference step follows
  `kl_penalty_step_lag`, and evals hold `exact_adapter_lease` when the backend has one.
  Its trainer also logs a wider set of per-step train metrics (`discarded/...`, `queue/...`,
  `offpolicy/...`, `sample_efficiency/...`; see `art_trio.stages.metrics`), which only this
  line's `model.log` keeps unprefixed, and its checkpoint rows carry no
  `time/wall_clock_sec`. Its trainer also stops on `LocalServingUnavailableError` from a
  rollout, records `completion_tokens` on each trajectory a rollout returns, validates eval
  `policy_token_spans`, and warns about the direct runtime keyword arguments.

Everything else in art_trio, its tests, demo, simulator and benchmark asks this module
instead of testing versions itself.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Any, Literal

import art
import pydantic

from .hooks import backend_hook


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


#: The installed ART release, as (major, minor, patch).
ART_VERSION: tuple[int, ...] = _release(importlib.metadata.version("openpipe-art"))

#: True on ART 0.5.20 and later: the line with a runtime config, `run_name` and
#: `optimizer_save_interval`. The only version test in art_trio.
ART_0520: bool = ART_VERSION >= (0, 5, 20)

#: Which trainer's per-step train metric names art_trio logs (see `art_trio.stages.metrics`):
#: "0.5.23" names (`discarded/cum/stale_groups`, `time/step_backend_train_s`, ...) on the
#: 0.5.20+ line, "0.5.18" names (`discarded_stale_groups`, `time/step_trainer_s`, ...) before.
#: Older `model.log`s prefix the new sections (`discarded/` -> `train/discarded/`), so the
#: new names would not reach an ART 0.5.18 dashboard where it expects them anyway.
TRAIN_METRIC_NAMES: Literal["0.5.18", "0.5.23"] = "0.5.23" if ART_0520 else "0.5.18"

#: Whether ART's trainer adds `time/wall_clock_sec` to its checkpoint history rows (0.5.18
#: does; 0.5.23's rows hold only `checkpoint/...`, `training_step`, `step`, `recorded_at`).
CHECKPOINT_ROW_WALL_CLOCK: bool = not ART_0520

#: The pipeline settings that ART 0.5.20+ moved into `PipelineRuntimeConfig`.
RUNTIME_FIELDS = ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize")


class _RuntimeConfig(pydantic.BaseModel):
    """ART 0.5.20's `PipelineRuntimeConfig`, for ART lines that do not ship it."""

    model_config = pydantic.ConfigDict(extra="forbid")

    num_rollout_workers: int = pydantic.Field(default=16, ge=1)
    min_batch_size: int = pydantic.Field(default=4, ge=1)
    max_batch_size: int | None = pydantic.Field(default=None, ge=1)
    queue_maxsize: int | None = pydantic.Field(default=None, ge=1)
    score_reference_groups_per_step: float | None = pydantic.Field(default=8.0, gt=0.0)
    score_reference_rollouts_per_group: float | None = pydantic.Field(default=None, gt=0.0)

    @pydantic.model_validator(mode="after")
    def _batch_bounds(self) -> _RuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError("max_batch_size must be >= min_batch_size")
        return self


class _AutotuneConfig(pydantic.BaseModel):
    """The part of ART 0.5.20's `PipelineAutotuneConfig` art_trio reads, for older lines."""

    model_config = pydantic.ConfigDict(extra="allow")

    mode: Literal["off", "online", "profile"] = "off"
    profile: str | None = None
    output_name: str = "latest"
    # The fields art_trio's autotuner honours (art_trio.autotune), with ART 0.5.23's
    # defaults.
    window_steps: int = pydantic.Field(default=4, ge=1)
    warmup_ignore_steps: int = pydantic.Field(default=3, ge=0)
    worker_load_change_windows: int = pydantic.Field(default=2, ge=1)
    max_rollout_workers: int = pydantic.Field(default=1024, ge=1)
    initial_model_calls_per_inference_gpu: int = pydantic.Field(default=8, ge=1)
    initial_min_groups_per_packed_sequence: int = pydantic.Field(default=8, ge=1)
    initial_max_groups_per_packed_sequence: int = pydantic.Field(default=8, ge=1)
    vllm_pressure_over_ratio: float = pydantic.Field(default=0.80, ge=0.0)
    vllm_metric_interval_s: float = pydantic.Field(default=1.0, gt=0.0)


if ART_0520:
    from art.pipeline_tuner import PipelineAutotuneConfig, PipelineRuntimeConfig
else:
    PipelineRuntimeConfig = _RuntimeConfig  # type: ignore[misc,assignment,unused-ignore]
    PipelineAutotuneConfig = _AutotuneConfig  # type: ignore[misc,assignment,unused-ignore]


def trainable_model(
    *, name: str, project: str, base_model: str, run_name: str | None = None, **kwargs: Any
) -> art.TrainableModel:
    """An `art.TrainableModel` built the way the installed line expects.

    ART 0.5.20+ requires `run_name` (the checkpoint directory's name); it defaults to `name`,
    which is where older lines keep the model. Older lines take no `run_name`.
    """
    if "run_name" in art.TrainableModel.model_fields:
        kwargs["run_name"] = run_name if run_name is not None else name
    elif run_name is not None and run_name != name:
        raise TypeError(
            f"run_name={run_name!r} needs openpipe-art 0.5.20 or later (installed: "
            f"{'.'.join(map(str, ART_VERSION))}); leave it out on this version"
        )
    model: art.TrainableModel = art.TrainableModel(
        name=name, project=project, base_model=base_model, **kwargs
    )
    return model


def line_train_kwargs(
    *,
    current_step: int,
    kl_penalty_coef: float,
    kl_penalty_reference_step: int | None,
    kl_penalty_step_lag: int | None,
    optimizer_save_interval: int,
    grad_accumulation_sequences: int | None,
) -> dict[str, Any]:
    """The `backend.train` keyword arguments that differ between lines, as each ART passes them.

    `current_step` is the step the batch trains from. An explicit `kl_penalty_reference_step`
    wins over `kl_penalty_step_lag` on either line.
    """
    kwargs: dict[str, Any] = {}
    if ART_0520:
        kwargs["optimizer_save_interval"] = optimizer_save_interval
        if grad_accumulation_sequences is not None:
            kwargs["grad_accumulation_sequences"] = grad_accumulation_sequences
    if kl_penalty_coef > 0.0:
        kwargs["kl_penalty_coef"] = kl_penalty_coef
        kwargs["kl_penalty_source"] = "sample"
        if kl_penalty_reference_step is not None:
            kwargs["kl_penalty_reference_step"] = kl_penalty_reference_step
        elif kl_penalty_step_lag is not None:
            kwargs["kl_penalty_reference_step"] = max(0, current_step - kl_penalty_step_lag)
        elif ART_0520:
            kwargs["kl_penalty_reference_step"] = 0
    return kwargs


def check_line_supports(*, grad_accumulation_sequences: int | None) -> None:
    """Refuse a setting the installed ART's backends cannot take, instead of dropping it."""
    if grad_accumulation_sequences is not None and not ART_0520:
        raise ValueError(
            "grad_accumulation_sequences needs openpipe-art 0.5.20 or later (Python 3.12+); "
            f"the installed {'.'.join(map(str, ART_VERSION))} cannot pass it to backend.train"
        )


def eval_lease(backend: object) -> Any | None:
    """The lease an eval at a step holds on that step's weights, or None if the backend has none.

    ART 0.5.20+ evaluates under `exact_adapter_lease` (the served weights are exactly that
    step's); older lines, and backends without it, under `adapter_lease`.
    """
    exact = backend_hook(backend, "exact_adapter_lease") if ART_0520 else None
    return exact if exact is not None else rollout_lease(backend)


def rollout_lease(backend: object) -> Any | None:
    """The lease a rollout holds on the weights of the step it samples from, if any (on the
    backend's class or set on the instance, see art_trio.plumbing.hooks)."""
    return backend_hook(backend, "adapter_lease")


def local_backend_is_dedicated(backend: Any, model: art.TrainableModel) -> bool:
    """Whether a LocalBackend trains and serves `model` on separate GPUs (ART's own test)."""
    supports = getattr(backend, "_supports_concurrent_training_and_inference", None)
    if ART_0520 and supports is not None:
        return bool(supports(model))
    from art.dev.validate import is_dedicated_mode

    return bool(is_dedicated_mode(model._internal_config or art.dev.InternalModelConfig()))


def record_completion_tokens(trajectory: art.Trajectory) -> None:
    """Set a trajectory's `completion_tokens` metric from its serving usage, as ART 0.5.20+'s
    rollout workers do with every trajectory a rollout returns (ART's own function: the
    exchanges' usage, else the choices' counts when every choice has one; it overwrites a
    value already there, as ART's does). A no-op on lines whose trainer does not record it.
    """
    if _record_completion_tokens is not None:
        _record_completion_tokens(trajectory)


_record_completion_tokens: Any = (
    getattr(importlib.import_module("art.gather"), "record_trajectory_completion_tokens", None)
    if ART_0520
    else None
)
#: Whether `record_completion_tokens` does anything on the installed ART (callers skip their
#: loop over a group's trajectories where it does not).
RECORDS_COMPLETION_TOKENS = _record_completion_tokens is not None


#: Rollout errors that end the run instead of counting as one failed rollout: ART 0.5.20+
#: re-raises `LocalServingUnavailableError` ("ART-managed local inference is unavailable and
#: training must stop"). Older lines have no such error.
FATAL_ROLLOUT_ERRORS: tuple[type[BaseException], ...] = (
    (importlib.import_module("art.errors").LocalServingUnavailableError,) if ART_0520 else ()
)


#: ART 0.5.20+'s `PolicyTokenSpan` (which policy version produced which tokens of a served
#: completion), the model its trainer validates eval provenance with; None on older lines,
#: whose servers annotate nothing (see art_trio.policy.provenance).
POLICY_TOKEN_SPAN: Any = (
    importlib.import_module("art.preprocessing.policy_spans").PolicyTokenSpan
    if ART_0520
    else None
)


def policy_spans_reported(model: Any) -> bool:
    """Whether every completion served to ``model`` carries ``policy_token_spans``: on ART
    0.5.20+ lines whose model knows its serving capabilities (0.5.23 sets them when it is
    registered with ART's LocalBackend), a runtime that reports spans ("require") or an
    immutable step-LoRA runtime whose spans ART's own client writes ("synthesize"). Then
    art_trio checks evals exactly as ART's trainer does (see art_trio.policy.provenance)."""
    if POLICY_TOKEN_SPAN is None:
        return False
    mode = getattr(model, "_policy_span_mode", None)
    if not callable(mode) or getattr(model, "_serving_capabilities", None) is None:
        return False
    try:
        return bool(mode() != "none")
    except Exception:  # a model ART's method cannot read: no promise of spans
        return False


def in_flight_updates(backend: Any, model: Any) -> bool:
    """Whether rollouts' weights are updated under them while they decode: a backend that
    says so (``CPUBackend(in_flight_updates=True)``), or, on ART 0.5.20+, serving
    capabilities with ``in_flight_lora_updates``. Their tokens then span several policies,
    each reported in ``policy_token_spans``."""
    if getattr(backend, "in_flight_updates", False) is True:
        return True
    capabilities = getattr(model, "_serving_capabilities", None)
    return getattr(capabilities, "in_flight_lora_updates", False) is True


def deprecate_direct_runtime(given: dict[str, Any], *, stacklevel: int) -> None:
    """ART 0.5.20+'s DeprecationWarning for the runtime settings given as keyword arguments
    (`num_rollout_workers=` and the rest), with ART's text; nothing on older lines, where
    they are the only spelling. `given` holds the ones set (not None)."""
    if ART_0520 and given:
        warnings.warn(
            "Direct PipelineTrainer runtime settings are deprecated; pass "
            "pipeline=PipelineRuntimeConfig(...) instead.",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
