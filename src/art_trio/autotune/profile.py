"""Autotuning's settings and saved profiles: ART's `autotune=` config (`AutotuneConfig`,
the fields honoured), the policy and runtime sizes a config asks for, and the profile file
saved beside the model (validated on load, replaced atomically on save).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pydantic

from ..messages.errors import ProfileError
from ..plumbing.compat import PipelineAutotuneConfig
from ..plumbing.files import atomic_write_json
from .policy import DEFAULT_TARGET_UTILIZATION, AutotunePolicy


class AutotuneConfig(PipelineAutotuneConfig):  # type: ignore[misc,valid-type,unused-ignore]
    """ART's `PipelineAutotuneConfig` plus art_trio's own knobs (ART's class drops unknown
    fields; this one keeps them)."""

    #: Trainer utilization to keep (time in `backend.train` over wall time, per window).
    target_utilization: float = pydantic.Field(default=DEFAULT_TARGET_UTILIZATION, gt=0.0,
                                               le=1.0)
    min_rollout_workers: int = pydantic.Field(default=1, ge=1)
    #: vLLM's Prometheus endpoint (`http://host:8000/metrics`); None: not read.
    inference_metrics_url: str | None = None


def config_field(config: Any, name: str, default: Any) -> Any:
    """A field of an autotune config: the attribute, else an extra field kept by pydantic
    (art_trio's knobs on ART's class), else `default`."""
    value = getattr(config, name, None)
    if value is None:
        extra = getattr(config, "model_extra", None) or {}
        value = extra.get(name, default)
    return value


def initial_runtime(config: Any) -> dict[str, int | None]:
    """The runtime settings a tuned run starts from, before any saved profile.

    Workers: `initial_model_calls_per_inference_gpu` (art_trio does not know how many
    inference GPUs serve the model: one is assumed), within `max_rollout_workers`. Batch
    sizes: `initial_min/max_groups_per_packed_sequence` (one packed sequence per step).
    """
    workers = min(int(config_field(config, "initial_model_calls_per_inference_gpu", 8)),
                  int(config_field(config, "max_rollout_workers", 1024)))
    max_batch = int(config_field(config, "initial_max_groups_per_packed_sequence", 8))
    min_batch = min(
        int(config_field(config, "initial_min_groups_per_packed_sequence", 8)), max_batch
    )
    return {"num_rollout_workers": workers, "min_batch_size": min_batch,
            "max_batch_size": max_batch, "queue_maxsize": None}


def policy_for(config: Any, runtime: dict[str, Any]) -> AutotunePolicy:
    """The policy an `autotune=` config asks for, starting at `runtime`.

    art_trio's own knobs (`target_utilization`, `min_rollout_workers`) are read where the
    config carries them (art_trio's replica keeps extra fields; ART's own class drops them).
    """
    return AutotunePolicy(
        num_rollout_workers=int(runtime["num_rollout_workers"]),
        min_batch_size=int(runtime["min_batch_size"]),
        max_batch_size=int(runtime["max_batch_size"]),
        target=float(config_field(config, "target_utilization", DEFAULT_TARGET_UTILIZATION)),
        min_workers=int(config_field(config, "min_rollout_workers", 1)),
        max_workers=int(config_field(config, "max_rollout_workers", 1024)),
        window_steps=int(config_field(config, "window_steps", 4)),
        warmup_steps=int(config_field(config, "warmup_ignore_steps", 3)),
        drift_windows=int(config_field(config, "worker_load_change_windows", 2)),
        inference_pressure_limit=float(config_field(config, "vllm_pressure_over_ratio", 0.8)),
    )


def profile_path(output_dir: str | Path, name: str | None) -> Path:
    """Where ART keeps a profile: `<model dir>/pipeline_tuner/<name>.json` (or a path)."""
    name = name or "latest"
    path = Path(name)
    if path.is_absolute() or path.suffix == ".json":
        return path
    return Path(output_dir) / "pipeline_tuner" / f"{name}.json"


_PROFILE_FIX = ("fix the field, or delete the file and run once with mode='online' to save a "
                "new profile")


def load_profile_settings(
    path: Path, *, model_name: str | None = None, max_workers: int | None = None
) -> dict[str, int | None]:
    """The runtime settings saved in a profile (ART's `settings` block, or art_trio's).

    A field missing or null falls back to the config's starting value; a field present must
    be a whole number the trainer accepts (`ProfileError` otherwise, naming the file and the
    field). A profile saved for another model is used, with a warning (as ART does for other
    mismatches: it may fit, a retune is recommended).
    """

    def broken(problem: str, fix: str = _PROFILE_FIX) -> ProfileError:
        return ProfileError(f"autotune profile {path}{problem}: {fix}")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise broken(f" is not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise broken(f" is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}; "
                     "a torn or hand-edited file)") from None
    if not isinstance(data, dict):
        raise broken(" must hold a JSON object with a `settings` object, found "
                     f"{type(data).__name__}")
    settings = data.get("settings")
    if not isinstance(settings, dict):
        found = "none" if settings is None else f"{settings!r:.60}"
        raise broken(": `settings` must be an object with num_rollout_workers, min_batch_size "
                     f"and max_batch_size, found {found}")
    loaded: dict[str, int | None] = {}
    for name in ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize"):
        value = loaded[name] = settings.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise broken(f": `settings.{name}` must be a whole number >= 1 (or null), found "
                         f"{value!r:.60}")
    low, high = loaded["min_batch_size"], loaded["max_batch_size"]
    if low is not None and high is not None and low > high:
        raise broken(f": `settings.min_batch_size` ({low}) is above `settings.max_batch_size` "
                     f"({high})")
    workers = loaded["num_rollout_workers"]
    if max_workers is not None and workers is not None and workers > max_workers:
        raise broken(f": `settings.num_rollout_workers` ({workers}) exceeds "
                     f"max_rollout_workers={max_workers}",
                     fix="raise max_rollout_workers, or " + _PROFILE_FIX)
    saved_for = data.get("model_name")
    if model_name is not None and isinstance(saved_for, str) and saved_for != model_name:
        warnings.warn(
            f"autotune profile {path} was saved by model {saved_for!r}, not {model_name!r}: "
            "its settings are applied, but a retune (mode='online') is recommended",
            UserWarning, stacklevel=3,
        )
    return loaded


def profile_document(
    policy: AutotunePolicy, config: Any, *, model_name: str | None, queue_maxsize: int | None
) -> dict[str, Any]:
    """The profile saved beside the model: ART's `PipelineAutotunerProfile` shape."""
    dump = getattr(config, "model_dump", None)
    return {
        "schema_version": 1,
        "model_name": model_name,
        "backend": "art_trio",
        "settings": {
            "num_rollout_workers": policy.num_rollout_workers,
            "min_batch_size": policy.min_batch_size,
            "max_batch_size": policy.max_batch_size,
            "queue_maxsize": queue_maxsize,
            "target_groups_per_step": policy.max_batch_size,
        },
        "config": dump(mode="json") if callable(dump) else {},
        "decisions": [
            {k: v for k, v in d.to_dict().items() if k != "window"} for d in policy.decisions
        ],
        "notes": [
            f"art_trio autotuner: fewest workers with trainer utilization >= {policy.target}",
            f"settled at step {policy.settled_at_step}" if policy.settled_at_step is not None
            else "not settled when saved",
        ],
    }


def save_profile(path: Path, document: dict[str, Any]) -> None:
    """Replace the profile durably: the old one or the new one survives a crash, never a torn
    or empty file (temporary file, fsync, rename, fsync of the directory: the ledger's write)."""
    # Through JSON once so that what the ledger's writer dumps is plain JSON: a non-finite
    # float becomes null, an object JSON cannot encode its repr.
    plain = json.loads(json.dumps(document, default=repr, allow_nan=True),
                       parse_constant=lambda _: None)
    atomic_write_json(path, plain, fsync=True)


def start_sizes(config: PipelineAutotuneConfig | None, model: Any) -> dict[str, int | None]:
    """A tuned run's starting sizes: a saved profile's where one is asked for (ART's rule:
    always with mode "profile", with "online" when `profile=` names one), else the config's
    initial ones (`initial_runtime`)."""
    runtime = initial_runtime(config)
    mode, name = getattr(config, "mode", "off"), getattr(config, "profile", None)
    if mode == "off" or model is None or (mode == "online" and not name):
        return runtime
    path = profile_path(model._get_output_dir(), name)
    if not path.exists():
        raise FileNotFoundError(
            f"autotune mode {mode!r} starts from a saved profile, and there is none at {path} "
            "(a run with mode='online' saves one there)"
        )
    loaded = load_profile_settings(
        path, model_name=getattr(model, "name", None),
        max_workers=getattr(config, "max_rollout_workers", None),
    )
    return {k: (loaded.get(k) if loaded.get(k) is not None else v) for k, v in runtime.items()}
