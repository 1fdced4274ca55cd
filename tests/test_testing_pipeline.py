"""The property suite for users (art_trio.testing.pipeline): a user's settings, latencies,
scenarios and rollout function run on the real trainer in virtual time, every invariant
checked, a misconfiguration caught with a readable (and, explored, shrunk) case."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import art
import pytest
from hypothesis import strategies as st

from art_trio import trio_native
from art_trio.sim import Exponential
from art_trio.testing import (
    PipelineCheckFailed,
    check_pipeline,
    checks,
    explore_pipeline,
    trajectory,
)
from art_trio.testing.pipeline import latencies

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"num_rollout_workers": 6, "min_batch_size": 2, "max_batch_size": 4}
SCENARIOS = [{"question": f"q{i}", "answer": i % 3} for i in range(12)]


def test_a_sound_configuration_passes_with_the_users_own_source_and_asyncio_rollout() -> None:
    seen: list[Any] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        import asyncio

        asyncio.get_running_loop()  # asyncio code, as ART users write it
        seen.append(scenario)
        return art.TrajectoryGroup(
            trajectory(float(g == scenario["answer"])) for g in range(3)
        )

    report = check_pipeline(
        SETTINGS | {"max_steps_off_policy": 1, "eval_every_n_steps": 2},
        rollout_latency=Exponential(5.0),
        source=SCENARIOS,
        rollout_fn=rollout,
        train_seconds=3.0,
        max_policy_age=1,
    )
    assert report.steps >= 3
    assert set(report.checked) >= {
        checks.OFF_POLICY, checks.BATCH_BOUNDS, checks.CONSERVATION, checks.EVAL,
        checks.CAPACITY, checks.RESUME, checks.POLICY_AGE,
    }
    # The user's rollout got the user's own scenarios: each one whose rollout was not
    # cancelled while in flight (stale-cancelled by admission) ended in that call.
    run = report.full.runs[0]
    returned = {f"q{a.scenario_id}" for a in run.attempts if a.outcome == "group"}
    assert returned and returned <= {s["question"] for s in seen}
    assert {s["question"] for s in seen} <= {s["question"] for s in SCENARIOS}
    assert report.resumed is not None and len(report.resumed.runs) == 2
    assert report.resumed.runs[0].stop_requested


def test_a_policy_lag_the_settings_allow_is_caught_with_its_case() -> None:
    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    with pytest.raises(PipelineCheckFailed) as caught:
        check_pipeline(
            SETTINGS,  # max_steps_off_policy left at the default, 4
            rollout_latency=[1.0, 9.0, 30.0],
            source=SCENARIOS,
            rollout_fn=rollout,
            train_seconds=5.0,
            max_policy_age=1,
        )
    assert caught.value.tag == checks.POLICY_AGE
    message = str(caught.value)
    assert message.startswith("[policy age] step ")
    assert "max_steps_off_policy=4" in message
    assert "rollout_latency=[1.0, 9.0, 30.0, 1.0" in message


def test_a_rollout_fn_whose_rollouts_all_fail_is_caught() -> None:
    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([ValueError("grader down"), ValueError("grader down")])

    with pytest.raises(PipelineCheckFailed) as caught:
        check_pipeline(SETTINGS, source=4, rollout_fn=rollout, resume=False)
    assert caught.value.tag == checks.TERMINATION
    assert "train() raised" in str(caught.value)


def test_explore_shrinks_a_counterexample() -> None:
    with pytest.raises(PipelineCheckFailed) as caught:
        explore_pipeline(
            SETTINGS | {"max_steps_off_policy": 3},
            rollout_latency=st.floats(0.0, 30.0),
            source=SCENARIOS,
            train_seconds=5.0,
            max_policy_age=1,
            max_examples=30,
        )
    assert caught.value.tag == checks.POLICY_AGE
    assert "(minimal, after shrinking)" in str(caught.value)
    # Shrunk: fewer scenarios than the source, and no resume stop later than needed.
    assert len(caught.value.case.plans) < len(SCENARIOS)


def test_explore_passes_a_sound_configuration_and_takes_a_settings_strategy() -> None:
    settings = st.fixed_dictionaries(
        {
            "num_rollout_workers": st.integers(1, 8),
            "min_batch_size": st.just(2),
            "max_batch_size": st.integers(2, 5),
            "max_steps_off_policy": st.integers(0, 2),
            "eval_every_n_steps": st.integers(0, 3),
            "eval_at_start": st.booleans(),
        }
    )
    explore_pipeline(
        settings, rollout_latency="exp:10", source=8, eval_seconds=st.floats(0, 20),
        max_policy_age=2, max_examples=20,
    )


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="rollout_latency gave -1.0"):
        check_pipeline(SETTINGS, rollout_latency=-1.0)
    with pytest.raises(ValueError, match="train_seconds"):
        check_pipeline(SETTINGS, train_seconds=[])
    with pytest.raises(ValueError, match="min_batch_size"):  # the trainer's own message
        check_pipeline(SETTINGS | {"min_batch_size": 0})


def test_latencies_from_each_form() -> None:
    assert latencies(2.0, 3) == (2.0, 2.0, 2.0)
    assert latencies([1.0, 2.0], 3) == (1.0, 2.0, 1.0)
    assert latencies(lambda i: i * 0.5, 3) == (0.0, 0.5, 1.0)
    assert latencies("exp:10", 4, seed=1) == latencies(Exponential(10.0), 4, seed=1)
    assert latencies("exp:10", 4, seed=1) != latencies("exp:10", 4, seed=2)


def test_importing_art_trio_or_check_pipeline_needs_no_optional_extra() -> None:
    code = (
        "import sys\n"
        "import art_trio, art_trio.testing\n"
        "from art_trio.testing import check_pipeline\n"
        "extras = {'hypothesis', 'prometheus_client'} & set(sys.modules)\n"
        "assert not extras, extras\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_testing_extra_declares_hypothesis_and_the_core_does_not() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("hypothesis") for d in project["dependencies"])
    assert any(d.startswith("hypothesis") for d in project["optional-dependencies"]["testing"])


def test_a_broken_trainer_is_caught_through_the_users_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only the user's own bound: the trainer's invariants are checked too. A gate and a
    batch filter one version too lenient (as in property_tests/test_mutants.py) break the
    off-policy bound of the user's own settings, and explore_pipeline says so."""
    import art_trio.policy.admission
    from art_trio.policy.batching import Freshness
    from art_trio.policy.gate import PolicyGate

    real_is_stale = Freshness.is_stale
    monkeypatch.setattr(
        art_trio.policy.admission,
        "reference_gate_allows",
        lambda s: s.policy_version >= s.next_training_step - s.max_steps_off_policy - 1,
    )
    monkeypatch.setattr(
        Freshness, "is_stale", lambda self, v, mean, step: real_is_stale(self, v, mean, step - 1)
    )
    monkeypatch.setattr(
        PolicyGate,
        "min_fresh_version",
        property(lambda self: self.next_training_step - self.max_steps_off_policy - 1),
    )
    with pytest.raises(PipelineCheckFailed) as caught:
        explore_pipeline(
            SETTINGS | {"max_steps_off_policy": 0},
            rollout_latency=st.floats(0.0, 30.0),
            source=SCENARIOS,
            train_seconds=5.0,
            max_examples=30,
        )
    assert caught.value.tag == checks.OFF_POLICY, caught.value
