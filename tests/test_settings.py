"""Constructor parity with ART's trainer: names, defaults, keyword-only placement, errors."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import types
from typing import Any

import pydantic
import pytest

from art_trio import PipelineTrainer
from art_trio.config.keywords import RUNTIME_DEFAULTS
from art_trio.plumbing.compat import (
    ART_0520,
    RUNTIME_FIELDS,
    PipelineAutotuneConfig,
    PipelineRuntimeConfig,
)
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs
from tests.doubles import asyncio_rollout

ArtPipelineTrainer = art_pipeline_trainer()

# The reference's parameters that ART 0.5.18 no longer has (it dropped the KL kwargs).
REFERENCE_ONLY = {"kl_penalty_coef": 0.0, "kl_penalty_reference_step": None}


def test_every_parameter_of_arts_trainer_with_the_same_default_and_kind() -> None:
    """Against the installed ART's own trainer, whichever line it is."""
    ours = inspect.signature(PipelineTrainer.__init__).parameters
    theirs = inspect.signature(ArtPipelineTrainer.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, f"missing parameter {name}"
        assert ours[name].kind == param.kind, name
        if name == "eval_at_start":
            # An alias of eval_step_0 here: None means "as eval_step_0 says" (default True).
            assert ours[name].default is None
            continue
        if name in RUNTIME_FIELDS:
            # None: "as pipeline= says, else ART's default" (0.5.20's spelling, both lines).
            assert ours[name].default is None
            assert param.default in (None, RUNTIME_DEFAULTS[name]), name
            continue
        assert ours[name].default == param.default, name
    for name, default in REFERENCE_ONLY.items():
        assert ours[name].default == default
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["eval_step_0"].default is True


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"num_rollout_workers": 0}, "num_rollout_workers must be > 0"),
    ({"min_batch_size": 0}, "min_batch_size must be > 0"),
    ({"max_batch_size": 0}, "max_batch_size must be > 0"),
    ({"min_batch_size": 4, "max_batch_size": 3}, "max_batch_size must be >= min_batch_size"),
    ({"max_steps_off_policy": -1}, "max_steps_off_policy must be >= 0"),
    ({"queue_maxsize": 0}, "queue_maxsize must be > 0"),
    ({"eval_every_n_steps": -1}, "eval_every_n_steps must be >= 0"),
    ({"max_steps": -1}, "max_steps must be >= 0"),
    ({"log_interval_seconds": 0}, "log_interval_seconds must be > 0"),
    ({"discard_queue_multiplier": 0}, "discard_queue_multiplier must be > 0"),
    ({"status_ewa_alpha": 0}, "status_ewa_alpha must be in (0, 1]"),
    ({"total_scenarios": -1}, "total_scenarios must be >= 0"),
    ({"checkpoint_retention_interval": 0}, "checkpoint_retention_interval must be > 0"),
    ({"shutdown_grace_seconds": -1}, "shutdown_grace_seconds must be >= 0"),
    ({"admission": "greedy"}, "admission must be one of"),
    ({"max_rollouts_beyond_bound": -1}, "max_rollouts_beyond_bound must be >= 0"),
    ({"packed_sequence_length": 0}, "packed_sequence_length must be > 0"),
    ({"optimizer_save_interval": 0}, "optimizer_save_interval must be > 0"),
    ({"kl_penalty_step_lag": 0}, "kl_penalty_step_lag must be >= 1"),
    ({"limit_mean_steps_off_policy": -1}, "limit_mean_steps_off_policy must be >= 0"),
    (
        {"pipeline": PipelineRuntimeConfig(), "num_rollout_workers": 2},
        "Use either pipeline=PipelineRuntimeConfig(...) or deprecated direct pipeline "
        "settings, not both.",
    ),
]
if ART_0520:
    BAD_VALUES.append(
        ({"grad_accumulation_sequences": 0}, "grad_accumulation_sequences must be >= 1")
    )


@pytest.mark.parametrize(("kwargs", "message"), BAD_VALUES)
def test_bad_values_raise_the_references_value_error(
    model: Any, backend: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        PipelineTrainer(model, backend, asyncio_rollout, [], None, **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), BAD_VALUES)
def test_every_value_error_of_the_installed_art_is_ours_verbatim(
    model: Any, backend: Any, kwargs: dict[str, Any], message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Walks each bad value through the installed ART's own trainer (0.5.18 or 0.5.20+).

    Where ART raises a ValueError, ours contains its text verbatim. Where ART's check is a
    pydantic field constraint (0.5.20+ validates the runtime settings with pydantic, whose
    generated text carries the input value and a docs URL), ours names the same field.
    Where ART accepts the value (checks of art_trio's own or of the reference only), there
    is nothing to match.
    """
    monkeypatch.setattr(ArtPipelineTrainer, "_validate_backend_support", lambda self: None)
    try:
        ArtPipelineTrainer(
            model, backend, asyncio_rollout, [], None, **art_trainer_kwargs(**kwargs)
        )
    except pydantic.ValidationError as art_error:
        fields = {str(error["loc"][0]) for error in art_error.errors() if error["loc"]}
        with pytest.raises(ValueError) as ours:
            PipelineTrainer(model, backend, asyncio_rollout, [], None, **kwargs)
        assert any(name in str(ours.value) for name in fields) or str(
            ours.value
        ).startswith("max_batch_size must be >= min_batch_size"), (fields, ours.value)
        return
    except ValueError as art_error:
        with pytest.raises(ValueError) as ours:
            PipelineTrainer(model, backend, asyncio_rollout, [], None, **kwargs)
        assert str(art_error) in str(ours.value)
        return
    except TypeError:
        return  # a parameter the installed ART does not have
    # ART took it: the check is art_trio's own (or the 0.5.17 reference's).


def test_defaults_resolve_like_the_reference(model: Any, backend: Any) -> None:
    trainer = PipelineTrainer(model, backend, asyncio_rollout, [], None, min_batch_size=3)
    assert trainer.max_batch_size == 30
    assert trainer.settings.groups_capacity == 4 * 30
    assert PipelineTrainer(
        model, backend, asyncio_rollout, [], None, max_steps_off_policy=0
    ).settings.groups_capacity == 1
    assert PipelineTrainer(
        model, backend, asyncio_rollout, [], None, queue_maxsize=7
    ).settings.groups_capacity == 7


def test_construction_needs_no_torch_or_local_backend() -> None:
    """The reference imports LocalBackend (torch) before checking the backend's type."""
    code = """
import os, sys
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import art
# Where torch is installed, ART's own import pulls it in (through transformers): only what
# art_trio adds is checked then.
torch_before = "torch" in sys.modules
from art_trio import PipelineTrainer
class Backend:
    async def train(self, model, groups, **kwargs):
        raise AssertionError("never trained")
from art_trio.plumbing.compat import trainable_model
model = trainable_model(name="m", project="p", base_model="b", base_path="/tmp/unused")
async def rollout(*args):
    return None
PipelineTrainer(model, Backend(), rollout, [], None)
assert "art.local.backend" not in sys.modules, "LocalBackend was imported"
assert torch_before or "torch" not in sys.modules, "torch was imported"
print("constructed")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "constructed" in done.stdout


@pytest.fixture
def fake_local_backend(monkeypatch: pytest.MonkeyPatch) -> type:
    """ART's LocalBackend needs torch; stand in its module so isinstance() sees our class."""
    module = types.ModuleType("art.local.backend")

    class LocalBackend:
        async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
            raise AssertionError("never trained")

    module.LocalBackend = LocalBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "art.local.backend", module)
    return LocalBackend


@pytest.mark.parametrize(
    ("internal", "kwargs", "message"),
    [
        ({}, {}, "PipelineTrainer only supports LocalBackend in dedicated mode. Shared "
         "LocalBackend pauses inference during training and is not a supported async "
         "PipelineTrainer path. Set both trainer_gpu_ids and inference_gpu_ids on the "
         "TrainableModel _internal_config to use LocalBackend with PipelineTrainer."),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}, {"loss_fn": "sft"},
         "loss_fn='cispo' or loss_fn='ppo'"),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}, {"loss_fn_config": {}},
         "loss_fn_config=None"),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}, {"adam_params": object()},
         "adam_params=None"),
    ],
)
def test_local_backend_must_be_dedicated(
    model: Any, fake_local_backend: type, internal: dict[str, Any], kwargs: dict[str, Any],
    message: str,
) -> None:
    object.__setattr__(model, "_internal_config", internal)
    with pytest.raises(ValueError, match=re.escape(message)):
        PipelineTrainer(model, fake_local_backend(), asyncio_rollout, [], None, **kwargs)


def test_dedicated_local_backend_is_accepted(model: Any, fake_local_backend: type) -> None:
    dedicated = {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}
    object.__setattr__(model, "_internal_config", dedicated)
    PipelineTrainer(model, fake_local_backend(), asyncio_rollout, [], None)
    # The reference refused this; no release of ART does (0.5.17 checks nothing, 0.5.18+
    # the four refusals above), so a ported script that sets it runs as it did.
    PipelineTrainer(
        model, fake_local_backend(), asyncio_rollout, [], None, normalize_advantages=False
    )


async def two_arguments(model: Any, scenario: Any) -> Any:
    raise AssertionError("never called")


@pytest.mark.parametrize(
    ("rollout_fn", "eval_fn", "scenarios", "message"),
    [
        ("not callable", None, [], "rollout_fn must be callable and return an awaitable.*str"),
        (asyncio_rollout, 42, [], "eval_fn must be callable.*got int"),
        (asyncio_rollout, None, None, "scenarios must be an iterable.*got NoneType"),
        (asyncio_rollout, None, "abc", "scenarios must be an iterable.*got str"),
        (two_arguments, None, [], r"rollout_fn is called as rollout_fn\(model, scenario, "
         r"config\), as ART calls it; two_arguments\(model.*, scenario.*cannot take that"),
        (asyncio_rollout, two_arguments, [], r"eval_fn is called as eval_fn\(model, step, "
         r"config\)"),
    ],
)
def test_the_usual_slips_fail_at_construction_with_what_to_do(
    model: Any, backend: Any, rollout_fn: Any, eval_fn: Any, scenarios: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        PipelineTrainer(model, backend, rollout_fn, scenarios, None, eval_fn)


@pytest.mark.parametrize(
    ("which", "given", "message"),
    [
        ("model", "mymodel", "model must be an art.TrainableModel.*got str"),
        ("backend", None, "backend must be an ART backend.*train.*got NoneType"),
        ("backend", object(), "backend must be an ART backend.*got object"),
    ],
)
def test_a_wrong_model_or_backend_fails_at_construction_not_after_rollouts(
    model: Any, backend: Any, which: str, given: Any, message: str
) -> None:
    """Found by trying it: both were accepted, and `train()` failed later with an
    AttributeError (the backend's only after rollouts had been spent)."""
    arguments = {"model": model, "backend": backend, which: given}
    with pytest.raises(TypeError, match=message):
        PipelineTrainer(arguments["model"], arguments["backend"], asyncio_rollout, [], None)


def test_pipeline_runtime_config_sets_the_runtime_settings(model: Any, backend: Any) -> None:
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, [], None,
        pipeline=PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2, queue_maxsize=5),
    )
    assert (trainer.num_rollout_workers, trainer.min_batch_size) == (3, 2)
    assert (trainer.max_batch_size, trainer.settings.groups_capacity) == (20, 5)


def test_autotune_modes_are_built_now(model: Any, backend: Any) -> None:
    """Online autotuning runs (tests/test_autotune.py); profile mode needs a saved profile."""
    trainer = PipelineTrainer(model, backend, asyncio_rollout, [], None,
                              autotune=PipelineAutotuneConfig(mode="online"))
    assert trainer.num_rollout_workers == 8  # ART's initial_model_calls_per_inference_gpu
    with pytest.raises(FileNotFoundError, match="saved profile"):
        PipelineTrainer(model, backend, asyncio_rollout, [], None,
                        autotune=PipelineAutotuneConfig(mode="profile"))
