"""Each setting is declared once (art_trio.config.settings); every other view is derived from it.

The flat keywords of `PipelineTrainer(...)` (the signature `inspect` shows; statically the
grouped form is what mypy checks), the grouped form, the attribute proxy and `resize`'s names
must all agree with the declarations, and ART's keywords of both lines must be accepted.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, get_type_hints

import pytest

import art_trio
import art_trio.config.keywords
import art_trio.config.settings
from art_trio import PipelineTrainer
from art_trio.config.keywords import RESOLVED_LATER, keyword_default, keyword_type
from art_trio.config.settings import (
    DECLARATIONS,
    FIELDS,
    GROUP_TYPES,
    GROUPS,
    Evaluation,
    FreshnessSettings,
    Persistence,
    PipelineSettings,
    Shutdown,
    Sizes,
    Status,
    Training,
)
from art_trio.plumbing.compat import ART_0520, RUNTIME_FIELDS
from tests.doubles import asyncio_rollout

# ART's constructor keywords (after `eval_fn`), read from each line's PipelineTrainer.
ART_0518_KEYWORDS = (
    "num_rollout_workers min_batch_size max_batch_size max_steps_off_policy queue_maxsize "
    "learning_rate loss_fn loss_fn_config normalize_advantages adam_params "
    "packed_sequence_length max_steps discard_queue_multiplier log_interval_seconds "
    "status_ewa_alpha total_scenarios eval_every_n_steps eval_at_start save_checkpoint "
    "checkpoint_retention_strategy checkpoint_retention_interval resume"
).split()
ART_0523_KEYWORDS = (
    "num_rollout_workers min_batch_size max_batch_size queue_maxsize pipeline autotune "
    "learning_rate loss_fn loss_fn_config normalize_advantages grad_accumulation_sequences "
    "adam_params kl_penalty_coef kl_penalty_step_lag max_steps discard_queue_multiplier "
    "max_steps_off_policy limit_mean_steps_off_policy score_reference_groups_per_step "
    "score_reference_rollouts_per_group log_interval_seconds status_ewa_alpha "
    "total_scenarios eval_every_n_steps eval_at_start save_checkpoint optimizer_save_interval "
    "checkpoint_retention_strategy checkpoint_retention_interval resume rollout_executor"
).split()
# The 0.5.17 reference's own (ART 0.5.18 dropped them, 0.5.20 brought back the coefficient).
REFERENCE_KEYWORDS = ["kl_penalty_coef", "kl_penalty_reference_step", "eval_step_0"]


def declared_types() -> dict[str, Any]:
    return {
        name: get_type_hints(GROUP_TYPES[group], vars(art_trio.config.settings))[name]
        for name, group in FIELDS.items()
    }


def test_each_setting_is_declared_once_with_a_doc() -> None:
    assert len(FIELDS) == 35
    assert set(GROUPS) == {
        "sizes", "freshness", "training", "evaluation", "persistence", "status", "shutdown"
    }
    for name, group in FIELDS.items():
        assert [f.name for f in dataclasses.fields(GROUP_TYPES[group])].count(name) == 1
        assert DECLARATIONS[name].metadata["doc"].strip(), f"{name} has no doc"
    assert sum(len(dataclasses.fields(t)) for t in GROUP_TYPES.values()) == len(FIELDS)


def test_the_keyword_view_is_typed_as_declared() -> None:
    """The signature (what IDEs and docs see) has every setting and group, typed as the
    declaration, or also None where another keyword decides (RESOLVED_LATER)."""
    parameters = inspect.signature(PipelineTrainer).parameters
    for name, declared in declared_types().items():
        expected = declared | None if name in RESOLVED_LATER else declared
        assert keyword_type(name) == parameters[name].annotation == expected, name
    for group in GROUPS:
        assert parameters[group].annotation == GROUP_TYPES[group] | None


def test_the_signature_spells_out_every_keyword_with_its_declared_default() -> None:
    parameters = inspect.signature(PipelineTrainer).parameters
    for name in (*FIELDS, *GROUPS):
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameter.default == keyword_default(name), name
        assert parameter.annotation == keyword_type(name), name
    for name, field in DECLARATIONS.items():
        if name not in RESOLVED_LATER:
            assert parameters[name].default == field.default, name
    assert set(RESOLVED_LATER) == {*RUNTIME_FIELDS, "eval_at_start"}


@pytest.mark.parametrize(
    "name", sorted(set(ART_0518_KEYWORDS) | set(ART_0523_KEYWORDS) | set(REFERENCE_KEYWORDS))
)
def test_every_art_keyword_of_both_lines_is_accepted(model: Any, backend: Any, name: str) -> None:
    """Each keyword at its default constructs a trainer on this line, whichever it is."""
    parameter = inspect.signature(PipelineTrainer).parameters[name]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    if name == "grad_accumulation_sequences" and not ART_0520:
        value: Any = None  # its default; a number needs ART 0.5.20 (a ValueError saying so)
    else:
        value = parameter.default
    trainer = PipelineTrainer(model, backend, asyncio_rollout, [], None, **{name: value})
    assert trainer.settings == PipelineTrainer(model, backend, asyncio_rollout, [], None).settings


def other_value(name: str) -> Any:
    """A valid value of the setting `name` that is not its default."""
    default = DECLARATIONS[name].default
    special: dict[str, Any] = {
        "admission": "eager",
        "loss_fn": "ppo",
        "loss_fn_config": {"clip": 0.1},
        "adam_params": object(),
        "checkpoint_retention_strategy": lambda context: [],
        "limit_mean_steps_off_policy": 2.0,
        "status_ewa_alpha": 0.5,
        "max_batch_size": 41,
        "stall_seconds": 120.0,
        "stall_action": "raise",
    }
    if name in special:
        return special[name]
    if isinstance(default, bool):
        return not default
    if default is None:
        return 3
    return default * 2 if default else 1.5


def settable() -> list[str]:
    return [n for n in FIELDS if ART_0520 or n != "grad_accumulation_sequences"]


@pytest.mark.parametrize("name", settable())
def test_every_setting_given_flat_reaches_its_group_and_the_attribute(
    model: Any, backend: Any, name: str
) -> None:
    value = other_value(name)
    trainer = PipelineTrainer(model, backend, asyncio_rollout, [], None, **{name: value})
    group = getattr(trainer.settings, FIELDS[name])
    assert getattr(group, name) == value
    assert getattr(trainer, name) == value
    assert trainer.settings.get(name) == value
    # Only max_batch_size follows another setting (10 x min_batch_size, ART's rule).
    changed = {name, "max_batch_size"} if name == "min_batch_size" else {name}
    untouched = {n: v for n, v in trainer.settings.flat().items() if n not in changed}
    defaults = PipelineTrainer(model, backend, asyncio_rollout, [], None).settings.flat()
    assert untouched == {n: v for n, v in defaults.items() if n not in changed}


def test_the_flat_and_grouped_forms_give_equal_settings(model: Any, backend: Any) -> None:
    values = {name: other_value(name) for name in settable()}
    flat = PipelineTrainer(model, backend, asyncio_rollout, [], None, **values).settings
    grouped = PipelineTrainer(
        model, backend, asyncio_rollout, [], None,
        **{
            group: GROUP_TYPES[group](
                **{n: v for n, v in values.items() if FIELDS[n] == group}
            )
            for group in GROUPS
        },
    ).settings
    assert grouped == flat
    assert flat.flat() == {**PipelineSettings().flat(), **values}
    assert PipelineSettings.from_flat(values) == flat


def test_the_grouped_form_and_pipeline_config_types(model: Any, backend: Any) -> None:
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, [], None,
        sizes=Sizes(num_rollout_workers=2, min_batch_size=1, max_batch_size=3),
        freshness=FreshnessSettings(max_steps_off_policy=1), training=Training(loss_fn="ppo"),
        evaluation=Evaluation(eval_every_n_steps=0), persistence=Persistence(resume=False),
        status=Status(total_scenarios=9), shutdown=Shutdown(max_steps=2),
    )
    assert (trainer.num_rollout_workers, trainer.max_batch_size, trainer.max_steps) == (2, 3, 2)
    assert trainer.settings.groups_capacity == 3


def test_a_misspelt_keyword_is_pythons_type_error_with_the_nearest_name(
    model: Any, backend: Any
) -> None:
    with pytest.raises(
        TypeError,
        match=r"^PipelineTrainer.__init__\(\) got an unexpected keyword argument "
        r"'max_bach_size'; did you mean 'max_batch_size'\?$",
    ):
        PipelineTrainer(model, backend, asyncio_rollout, [], None, max_bach_size=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'$"):
        PipelineTrainer(model, backend, asyncio_rollout, [], None, zzz=1)  # type: ignore[call-arg]


def test_a_setting_given_twice_or_a_group_of_the_wrong_type_is_refused(
    model: Any, backend: Any
) -> None:
    with pytest.raises(
        TypeError,
        match=r"max_steps is given twice with different values: 3 as a keyword and 4 in "
        r"shutdown=Shutdown\(\.\.\.\)",
    ):
        PipelineTrainer(
            model, backend, asyncio_rollout, [], None, max_steps=3, shutdown=Shutdown(max_steps=4)
        )
    with pytest.raises(TypeError, match=r"sizes must be an art_trio.Sizes, got dict"):
        PipelineTrainer(model, backend, asyncio_rollout, [], None, sizes={"x": 1})  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match=r"either sizes=Sizes\(\.\.\.\) or pipeline="):
        from art_trio.plumbing.compat import PipelineRuntimeConfig

        PipelineTrainer(
            model, backend, asyncio_rollout, [], None,
            sizes=Sizes(), pipeline=PipelineRuntimeConfig(),
        )


def test_resize_takes_the_sizes_group_names(model: Any, backend: Any) -> None:
    names = {
        n for n, p in inspect.signature(PipelineTrainer.resize).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "reason"
    }
    assert names == {f.name for f in dataclasses.fields(Sizes)}
    trainer = PipelineTrainer(model, backend, asyncio_rollout, [], None)
    trainer.resize(max_batch_size=12)
    assert trainer.settings.sizes.max_batch_size == trainer.max_batch_size == 12


def test_replace_checks_names_and_values() -> None:
    settings = PipelineSettings()
    with pytest.raises(TypeError, match="unknown setting 'max_bach_size'"):
        settings.replace(max_bach_size=3)
    with pytest.raises(ValueError, match="^max_batch_size must be >= min_batch_size$"):
        settings.replace(max_batch_size=2)
    assert settings.replace(max_steps=4).shutdown.max_steps == 4
    assert settings.replace(max_steps=4).sizes is settings.sizes


USER_CODE = '''
from typing import Any

from art_trio import FreshnessSettings, PipelineTrainer, Sizes


def build(model: Any, backend: Any, rollout: Any) -> None:
    PipelineTrainer(model, backend, rollout, [], None, max_batch_size=8, learning_rate=1e-4)
    PipelineTrainer(model, backend, rollout, [], None, sizes=Sizes(max_batch_size=8))
    PipelineTrainer(model, backend, rollout, [], None, sizes=Sizes(max_bach_size=8))
    PipelineTrainer(model, backend, rollout, [], None, sizes=Sizes(max_batch_size="8"))
    PipelineTrainer(model, backend, rollout, [], None, freshness=FreshnessSettings(admission="x"))
'''


def test_a_users_mypy_sees_each_settings_groups_fields_and_types(tmp_path: Path) -> None:
    """The typed view (the groups, given whole) as mypy reads it: the good calls pass (a flat
    keyword is checked when the trainer is built), a misspelt name and wrong types are
    errors on their lines."""
    user = tmp_path / "user.py"
    user.write_text(USER_CODE)
    # art_trio is read; what it imports (ART, anyio, ...) is skipped (as Any): reading ART's
    # own dependencies would take minutes and is not what this test is about.
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = skip\n"
        "[mypy-art_trio.*]\nfollow_imports = normal\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental",
         "--python-version", "3.11", "--cache-dir", str(tmp_path / "cache"), str(user)],
        capture_output=True, text=True,
        env={**os.environ, "MYPYPATH": str(Path(art_trio.__file__).parents[1])},
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [10, 11, 12], result.stdout
    assert 'Unexpected keyword argument "max_bach_size"' in errors[0]
    assert 'expected "int"' in errors[1]
    assert "Literal['staleness_aware', 'eager']" in errors[2]
