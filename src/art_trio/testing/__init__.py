"""Testing art_trio pipelines: the doubles, and the property suite for users.

- :mod:`art_trio.testing.doubles`: ART's Backend protocol and an eval function as doubles
  (shared by art_trio's tests, the property harness, the simulator and the benchmark);
- :mod:`art_trio.testing.pipeline`: :func:`check_pipeline` (your settings, latencies, source
  and rollout function, run in virtual time against every scheduler invariant) and
  :func:`explore_pipeline`, its Hypothesis-driven variant;
- :mod:`art_trio.testing.checks`: the invariants, one check each;
- :mod:`art_trio.testing.distributions`: duration distributions, sampled reproducibly (the
  simulator's too: ``art_trio.sim`` builds on this package, never the reverse);
- :func:`art_pipeline_trainer` and :func:`art_trainer_kwargs`: the installed ART's own
  ``PipelineTrainer`` and its keyword spelling, for side-by-side runs (the benchmark's), and
  :func:`trainable_model` (``art_trio.trainable_model``) for the model both trainers get;
- :mod:`art_trio.testing.harness`: runs a :class:`~art_trio.testing.harness.Case` on the real
  trainer under trio's ``MockClock`` and records what its doubles saw;
- :mod:`art_trio.testing.strategies`: Hypothesis strategies of cases (needs Hypothesis:
  ``pip install "art-trio[testing]"``);
- the pytest plugin (fixture ``art_trio_pipeline``) is the package ``art_trio_pytest``, apart
  from ``art_trio`` so that pytest runs that do not use it never import the trainer.

Only the doubles and the side-by-side helpers are imported eagerly: they import nothing from
the rest of art_trio but ``art_trio.plumbing.compat`` (ART's line differences), so the
benchmark's ART child process, which never runs ``art_trio/__init__.py``, can load them without
the trainer (trio-asyncio), and nothing here imports Hypothesis until a strategy is asked for.
The other names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from art_trio.plumbing.compat import (
    ART_0520,
    RUNTIME_FIELDS,
    PipelineRuntimeConfig,
    trainable_model,
)
from art_trio.testing.doubles import (
    BackendDouble,
    EvalCall,
    EvalDouble,
    Flavor,
    TrainBatch,
    clock_for,
    group_initial_version,
    trajectory,
    trajectory_group,
)

if TYPE_CHECKING:
    from art_trio.testing.harness import Case, CaseResult, Config, PlannedRolloutError, RolloutPlan
    from art_trio.testing.pipeline import (
        PipelineCheckFailed,
        PipelineReport,
        check_case,
        check_pipeline,
        explore_pipeline,
    )


def art_pipeline_trainer() -> type[Any]:
    """The installed ART's own `PipelineTrainer` class (for side-by-side runs)."""
    from art.pipeline_trainer import PipelineTrainer

    return PipelineTrainer


def art_trainer_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for the installed ART's own `PipelineTrainer`, from 0.5.18-style ones.

    Used where art_trio runs ART's trainer beside its own (the benchmark, differential tests).
    0.5.20+ takes the runtime settings as `pipeline=PipelineRuntimeConfig(...)`, calls
    `eval_step_0` only `eval_at_start`, and has no `packed_sequence_length`.
    """
    if "eval_step_0" in kwargs:
        kwargs.setdefault("eval_at_start", kwargs.pop("eval_step_0"))
    if not ART_0520:
        return kwargs
    runtime = {key: kwargs.pop(key) for key in RUNTIME_FIELDS if key in kwargs}
    if "pipeline" not in kwargs:
        kwargs["pipeline"] = PipelineRuntimeConfig(**runtime)
    kwargs.pop("packed_sequence_length", None)
    return kwargs


#: Public names loaded on first use, and the module each comes from.
_LAZY = {
    "Case": "harness",
    "CaseResult": "harness",
    "Config": "harness",
    "PlannedRolloutError": "harness",
    "RolloutPlan": "harness",
    "PipelineCheckFailed": "pipeline",
    "PipelineReport": "pipeline",
    "check_case": "pipeline",
    "check_pipeline": "pipeline",
    "explore_pipeline": "pipeline",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"art_trio.testing.{module}"), name)


__all__ = [
    "BackendDouble",
    "Case",
    "CaseResult",
    "Config",
    "EvalCall",
    "EvalDouble",
    "Flavor",
    "PipelineCheckFailed",
    "PipelineReport",
    "PlannedRolloutError",
    "RolloutPlan",
    "TrainBatch",
    "art_pipeline_trainer",
    "art_trainer_kwargs",
    "check_case",
    "check_pipeline",
    "clock_for",
    "explore_pipeline",
    "group_initial_version",
    "trainable_model",
    "trajectory",
    "trajectory_group",
]
