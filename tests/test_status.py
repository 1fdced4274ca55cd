"""Behaviour 11: the live status line on a TTY and the periodic `[status]` log line."""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import art
import pytest

from art_trio import PipelineTrainer, StatusReporter
from art_trio.messages.events import (
    EvalEnded,
    EvalStarted,
    GroupQueued,
    RolloutEnded,
    RolloutStarted,
    RunEvent,
    ScenarioSettled,
    StepTrained,
)
from art_trio.messages.values import Fate
from art_trio.observation.fates import CounterFold
from art_trio.observation.status import ZERO_VARIANCE_NOTE, reward_summary
from tests.doubles import RecordingBackend, scenarios, trajectory


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(r) for r in rewards])


def trained(batch: list[art.TrajectoryGroup], *, step: int, step_seconds: float) -> list[RunEvent]:
    """The events the training stage emits for `batch` trained as `step`: each group's fate,
    then the step."""
    reward_mean, reward_std_mean, flat = reward_summary(batch)
    fates: list[RunEvent] = [ScenarioSettled(i, Fate.TRAINED, 1.0, True) for i in range(len(batch))]
    return [
        *fates,
        StepTrained(
            step=step,
            batch_size=len(batch),
            scenario_indices=tuple(range(len(batch))),
            staleness=(0,) * len(batch),
            wall_s=step_seconds,
            train_s=step_seconds,
            reward_mean=reward_mean,
            reward_std_mean=reward_std_mean,
            zero_variance_groups=flat,
        ),
    ]


def feed(status: StatusReporter, events: list[RunEvent]) -> None:
    for event in events:
        status(event)


def test_counts_and_smoothed_numbers_in_the_full_line() -> None:
    now = [0.0]
    out = io.StringIO()
    status = StatusReporter(
        get_scenario_offset=lambda: 7,
        log_interval_seconds=10,
        status_ewa_alpha=0.5,
        total_scenarios=10,
        num_workers=4,
        clock=lambda: now[0],
        stream=out,
    )
    status.start(initial_step=0)
    # The reporter folds the run's events: nothing else changes its counts.
    status(RolloutStarted(0))
    status(RolloutStarted(1))
    status(RolloutEnded(0, 1.0))
    status(ScenarioSettled(0, Fate.ERRORED, 0.0))
    status(GroupQueued(2, 1))
    status(ScenarioSettled(3, Fate.STALE, 1.0))
    status(ScenarioSettled(4, Fate.CANCELLED_STALE, 1.0))
    feed(status, trained([group(0.0, 1.0), group(1.0, 1.0)], step=1, step_seconds=4.0))
    feed(status, trained([group(1.0, 1.0)], step=2, step_seconds=2.0))
    status(EvalEnded(2, True, 0.9))
    line = status.full_line()
    # Plain words: a newcomer reads it without ART's source.
    assert line.startswith(
        "[status] step 2 | trained 1 groups, 1 queued, 0 in training, 3 scenarios left | "
        "skipped 5 groups: 2 with identical rewards (no learning signal), "
        "2 too stale (beyond max_steps_off_policy), 1 whose rollout failed | "
        "rollouts: 1 of 4 workers busy | "
    ), line
    # EWA with alpha 0.5: reward 0.75 then 1.0 -> 0.875; seconds 4 then 2 -> 3.0
    assert "train: reward 0.875, 3.00 s/step, reward std 0.125 (smoothed)" in line
    assert line.endswith("| val: reward 0.900 at step 2"), line


def test_nothing_skipped_says_none_and_a_running_eval_names_its_step() -> None:
    status = StatusReporter(get_scenario_offset=lambda: 0)
    status(EvalStarted(4))
    line = status.full_line()
    assert "| skipped none |" in line
    assert line.endswith("val: reward n/a, evaluating step 4"), line


def test_a_part_added_to_the_line_is_shown_unless_it_has_nothing_to_say() -> None:
    status = StatusReporter(get_scenario_offset=lambda: 0)
    said: list[str | None] = [None]
    status.add_part(lambda: said[0])
    assert not status.full_line().endswith(" | ")
    said[0] = "stalled: no step for 600 s"
    assert status.full_line().endswith(" | stalled: no step for 600 s")


def test_many_identical_reward_skips_are_explained_once() -> None:
    out = io.StringIO()
    status = StatusReporter(get_scenario_offset=lambda: 0, stream=out, log_interval_seconds=1)
    status.start()
    feed(status, trained([group(1.0, 1.0), group(0.0, 1.0)], step=1, step_seconds=1.0))
    status.flush()
    assert ZERO_VARIANCE_NOTE not in out.getvalue()  # one skip beside one trained: no note
    for scenario in range(20):
        status(ScenarioSettled(scenario, Fate.ZERO_VARIANCE, 0.0))
    status.flush()
    status.flush()
    text = out.getvalue()
    assert text.count(ZERO_VARIANCE_NOTE) == 1
    assert "no learning signal" in ZERO_VARIANCE_NOTE and "normal" in ZERO_VARIANCE_NOTE
    # Every line the reporter prints is a [status] line (stdout stays greppable).
    assert all(line.startswith("[status]") for line in text.splitlines())


def test_the_log_line_is_due_every_interval_of_the_given_clock() -> None:
    now = [100.0]
    out = io.StringIO()
    status = StatusReporter(
        get_scenario_offset=lambda: 0, log_interval_seconds=60, clock=lambda: now[0], stream=out
    )
    status.start()
    status.log_if_due()  # the first line is due at once
    now[0] += 59
    status.log_if_due()
    assert status.seconds_until_log() == pytest.approx(1.0)
    now[0] += 1
    status.log_if_due()
    assert out.getvalue().count("[status]") == 2


def test_a_tty_gets_a_live_condensed_line() -> None:
    tty = FakeTTY()
    status = StatusReporter(
        get_scenario_offset=lambda: 0, log_interval_seconds=60, stream=tty, clock=lambda: 0.0
    )
    status.start(initial_step=3)
    feed(status, trained([group(0.0, 1.0)], step=4, step_seconds=1.5))
    assert "step 4 · 1 trained · 0 queued · 0 training · 0 skipped · reward 0.50 · 1.5 s/step" in (
        tty.getvalue()
    )
    status.close()


def test_the_condensed_line_drops_fields_to_fit_narrow_terminals() -> None:
    status = StatusReporter(get_scenario_offset=lambda: 0, total_scenarios=100)
    status(EvalStarted(0))
    wide = status.condensed_line(width=200)
    narrow = status.condensed_line(width=60)
    assert "std -" in wide and "(evaluating)" in wide and "100 left" in wide
    assert "std" not in narrow and "evaluating" not in narrow
    assert len(narrow) <= 60, narrow
    assert "skipped" in narrow and "val" in narrow


async def test_the_trainer_prints_a_status_line_every_log_interval(model, capsys, autojump_clock):
    backend = RecordingBackend(train_seconds=10.0)
    object.__setattr__(model, "_backend", backend)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(5.0)
        return group(0.0, 1.0)

    await PipelineTrainer(
        model,
        backend,
        rollout,
        scenarios(8),
        None,
        num_rollout_workers=2,
        min_batch_size=2,
        max_batch_size=2,
        log_interval_seconds=20.0,
    ).train(handle_signals=False)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[status]")]
    # 4 steps of 5 s rollouts + 10 s training, overlapped: about 45 virtual seconds, so lines at
    # 0, 20 and 40 s plus the final flush.
    assert len(lines) == 4
    assert "trained 8 groups" in lines[-1]


def test_huge_finite_rewards_are_summarised_without_overflow() -> None:
    """Finite rewards near float's largest are valid input: the status line's statistics
    must not raise OverflowError squaring their deviations (the step itself trained)."""
    batch = [group(1.7e308, 0.0, 0.0, 0.0), group(-1.7e308, 1.7e308)]
    mean, std, flat = reward_summary(batch)
    assert std == pytest.approx((math.sqrt(3) / 4 * 1.7e308 + 1.7e308) / 2)
    assert flat == 0 and mean is not None


def test_the_line_the_getting_started_guide_explains_is_the_line_printed() -> None:
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    quoted = next(line for line in guide.splitlines() if line.startswith("[status] step 34"))
    status = StatusReporter(get_scenario_offset=lambda: 0, num_workers=4)
    counts = status.counters
    counts.trained, counts.delivered, counts.zero_variance, counts.rollouts_started = 120, 2, 342, 3
    status.step, status.val_step, status.val_reward = 34, 32, 0.999
    status.reward_ewa, status.step_seconds_ewa, status.reward_std_ewa = 0.991, 0.21, 0.021
    assert status.full_line() == quoted


def test_the_counts_are_the_runs_counters_not_a_second_tally() -> None:
    # The run's CounterFold hears each event first; the reporter shows its counts and folds
    # only what they do not keep (here: nothing it was handed directly).
    fold = CounterFold()
    status = StatusReporter(get_scenario_offset=lambda: 0, num_workers=4, counters=fold)
    for event in [
        RolloutStarted(0),
        RolloutStarted(1),
        RolloutStarted(2),
        RolloutEnded(0, 1.0),
        GroupQueued(0, 1),
        ScenarioSettled(1, Fate.ERRORED, 0.0),
        ScenarioSettled(2, Fate.CANCELLED_STALE, 1.0),
        *trained([group(0.0, 1.0), group(1.0, 1.0)], step=1, step_seconds=1.0),
    ]:
        fold(event)
    assert status.counters is fold.counters
    line = status.full_line()
    assert "trained 1 groups, 1 queued" in line, line
    assert "skipped 3 groups: 1 with identical rewards" in line, line
    assert "rollouts: 2 of 4 workers busy" in line, line
    # More ends than starts (never in a run) show as they are, not clamped at zero.
    for index in range(3):
        fold(RolloutEnded(index, 1.0))
    assert status.rolling_out == -1
