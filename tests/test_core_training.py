"""Behaviour 5, 6, 7: batch collection, what backend.train receives, logging then publishing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.plumbing.compat import TRAIN_METRIC_NAMES, line_train_kwargs
from tests.doubles import HISTORY_KEYS, RecordingBackend, asyncio_rollout, scenarios, trajectory


def history(model: Any) -> list[dict[str, Any]]:
    path = Path(model._get_output_dir()) / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_batches_wait_for_min_then_take_what_is_ready_up_to_max(model, autojump_clock):
    backend = RecordingBackend(train_seconds=10.0)
    object.__setattr__(model, "_backend", backend)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(1.0 + scenario["i"] * 0.01)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(30), None, num_rollout_workers=10,
        min_batch_size=2, max_batch_size=5, max_steps_off_policy=5, max_steps=3,
        admission="eager",
    ).train(handle_signals=False)
    sizes = [len(c.scenario_ids) for c in backend.calls]
    # Step 1 starts as soon as 2 are ready (the rest finish 10 ms apart); while it trains
    # for 10 s the others pile up, so later steps take the maximum.
    assert sizes == [2, 5, 5]


async def test_stale_groups_are_discarded_and_counted(model, backend):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        # Scenarios 2 and 5 claim to come from a policy far behind (version -10).
        version = -10 if scenario["i"] in (2, 5) else None
        return art.TrajectoryGroup(
            [trajectory(r, initial_policy_version=version) for r in (0.0, 1.0)]
        )

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(8), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2, max_steps_off_policy=1,
    )
    await trainer.train(handle_signals=False)
    assert sorted(i for c in backend.calls for i in c.scenario_ids) == [0, 1, 3, 4, 6, 7]
    assert trainer.last_counters is not None and trainer.last_counters.stale == 2
    stale_key = HISTORY_KEYS["stale_groups"]
    last = [r for r in history(model) if stale_key in r][-1]
    assert last[stale_key] == 2


async def test_zero_variance_groups_are_held_then_logged_as_discarded(model, backend):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] == 1:
            return art.TrajectoryGroup([trajectory(0.5), trajectory(0.5)])
        if scenario["i"] == 2:
            return art.TrajectoryGroup([trajectory(1.0)])  # one trajectory: no variance
        return await asyncio_rollout(model, scenario, config)

    with pytest.warns(RuntimeWarning, match="of one trajectory"):
        await PipelineTrainer(
            model, backend, rollout, scenarios(6), None,
            num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
        ).train(handle_signals=False)
    assert sorted(i for c in backend.calls for i in c.scenario_ids) == [0, 3, 4, 5]
    discarded = Path(model._get_output_dir()) / "trajectories" / "discarded"
    assert [p.name for p in discarded.iterdir()] == ["0001.parquet"]


async def test_collapse_stops_training_exactly_at_the_limit(model, backend, caplog):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([trajectory(1.0), trajectory(1.0)])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(100), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, discard_queue_multiplier=3,
    )
    await trainer.train(handle_signals=False)
    assert backend.calls == []
    assert trainer.last_counters is not None
    assert trainer.last_counters.zero_variance == 6  # 3 * min_batch_size, not one fewer or more
    out = caplog.text
    assert "MODEL COLLAPSE DETECTED - Training stopped" in out
    assert "discard_queue_multiplier" in out


async def test_groups_of_one_trajectory_are_said_to_be_too_small_not_a_collapse(
    model, backend, caplog
):
    """A rollout_fn returning one trajectory per group (a single rollout, ported as is)
    trains nothing; the first such group is warned about, once, and the stop says the groups
    are too small rather than that the policy collapsed."""

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([trajectory(float(scenario["i"] % 2))])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(100), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, discard_queue_multiplier=3,
    )
    with pytest.warns(RuntimeWarning) as record:
        await trainer.train(handle_signals=False)
    lone = [str(w.message) for w in record if "of one trajectory" in str(w.message)]
    assert len(lone) == 1 and "make_group_rollout_fn" in lone[0], lone
    assert backend.calls == []
    assert "the policy has not collapsed" in caplog.text
    assert "MODEL COLLAPSE" not in caplog.text


async def test_backend_train_receives_the_references_kwargs(model, backend):
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, learning_rate=3e-4, loss_fn="ppo",
        loss_fn_config={"clip": 0.2}, normalize_advantages=False, adam_params={"beta1": 0.8},
    ).train(handle_signals=False)
    assert backend.calls[0].kwargs == {
        "learning_rate": 3e-4,
        "loss_fn": "ppo",
        "loss_fn_config": {"clip": 0.2},
        "normalize_advantages": False,
        "save_checkpoint": False,
        "adam_params": {"beta1": 0.8},
        # What the installed ART line adds (0.5.20+: optimizer_save_interval=5).
        **line_train_kwargs(
            current_step=0, kl_penalty_coef=0.0, kl_penalty_reference_step=None,
            kl_penalty_step_lag=None, optimizer_save_interval=5,
            grad_accumulation_sequences=None,
        ),
    }


async def test_kl_reference_step_lags_the_step_being_trained_from(model, backend):
    """ART 0.5.20's kl_penalty_step_lag, on either line: reference = max(0, step - lag)."""
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(8), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, kl_penalty_coef=0.1, kl_penalty_step_lag=2,
    ).train(handle_signals=False)
    assert [call.kwargs["kl_penalty_reference_step"] for call in backend.calls] == [0, 0, 0, 1]
    assert {call.kwargs["kl_penalty_source"] for call in backend.calls} == {"sample"}


async def test_kl_kwargs_exactly_when_the_coefficient_is_positive(model, backend):
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, kl_penalty_coef=0.1, kl_penalty_reference_step=3,
        packed_sequence_length=2048,
    ).train(handle_signals=False)
    kwargs = backend.calls[0].kwargs
    assert kwargs["kl_penalty_coef"] == 0.1
    assert kwargs["kl_penalty_source"] == "sample"
    assert kwargs["kl_penalty_reference_step"] == 3
    assert kwargs["packed_sequence_length"] == 2048


async def test_save_checkpoint_only_on_eval_steps(model, backend):
    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(1.0)]

    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(10), None, eval_fn, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    ).train(handle_signals=False)
    assert [c.kwargs["save_checkpoint"] for c in backend.calls] == [False, True, False, True, False]
    no_checkpoints = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None, eval_fn, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, eval_every_n_steps=1, save_checkpoint=False,
        resume=False,
    )
    backend.calls.clear()
    await no_checkpoints.train(handle_signals=False)
    assert [c.kwargs["save_checkpoint"] for c in backend.calls] == [False, False]


async def test_each_step_logs_the_references_metric_keys(model, backend):
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    rows = {r["step"]: r for r in history(model) if "train/reward" in r}
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        # The installed ART line's names (art_trio.stages.metrics), and the backend's own metrics.
        assert {*HISTORY_KEYS.values(), "train/loss"} <= set(row)
        if TRAIN_METRIC_NAMES == "0.5.18":
            assert "train/steps_off_policy" in row
    assert (Path(model._get_output_dir()) / "trajectories" / "train" / "0002.parquet").exists()


async def test_the_new_version_is_published_only_after_the_step_is_logged(
    model, backend, autojump_clock
):
    """No rollout samples policy s before model.log for step s has returned.

    Virtual time: on the real clock a loaded machine can delay a rollout enough to make its
    group stale, and then fewer than 6 steps train."""
    logged_at: dict[int, int] = {}
    events = 0
    original_log = model.log

    async def log(*args: Any, **kwargs: Any) -> None:
        nonlocal events
        await original_log(*args, **kwargs)
        if kwargs.get("split") == "train":
            events += 1
            logged_at[kwargs["step"]] = events

    object.__setattr__(model, "log", log)
    started: list[tuple[int, int]] = []  # (event count when started, version it sampled)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        mark = events
        group = await asyncio_rollout(model, scenario, config)
        started.append((mark, -1))
        return group

    original_train = backend.train

    async def spy(model_: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        for g in groups:
            for t in g.trajectories:
                assert t.initial_policy_version is not None
                version = t.initial_policy_version
                # A group that sampled version v > 0 started after step v was logged.
                assert version == 0 or version in logged_at
        return await original_train(model_, groups, **kwargs)

    backend.train = spy  # type: ignore[method-assign]
    await PipelineTrainer(
        model, backend, rollout, scenarios(12), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, max_steps_off_policy=1,
    ).train(handle_signals=False)
    assert len(logged_at) == 6


async def test_the_groups_channel_is_bounded(model, autojump_clock):
    backend = RecordingBackend(train_seconds=100.0)
    object.__setattr__(model, "_backend", backend)
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(200), None, num_rollout_workers=20,
        min_batch_size=2, max_batch_size=2, queue_maxsize=3, max_steps=2, admission="eager",
    )
    await trainer.train(handle_signals=False)
    counters = trainer.last_counters
    assert counters is not None
    # Delivered but not trained: in the channel (<= 3), held ready by the trainer (<= one
    # batch in eager mode), or held by workers blocked handing over (<= 20).
    assert counters.max_queued <= 3 + 2 + 20


async def test_a_batch_takes_the_groups_of_workers_blocked_on_the_full_channel(
    model, autojump_clock
):
    """Taking a group from a full channel moves a blocked worker's group into it at once, so
    "what is already queued" includes the blocked workers' groups. (A bound that only wakes
    the blocked worker, as an anyio CapacityLimiter in front of an unbounded stream would,
    leaves its group out until the worker runs: these batches shrank to 1 group each.)"""
    backend = RecordingBackend(train_seconds=10.0)
    object.__setattr__(model, "_backend", backend)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(1.0)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(40), None, num_rollout_workers=6,
        min_batch_size=1, max_batch_size=4, queue_maxsize=1, max_steps_off_policy=8,
        max_steps=4, admission="eager",
    ).train(handle_signals=False)
    # While a step trains, 1 group waits in the channel and 5 workers block behind it; the
    # next batch takes the channel's group and, as each is taken, the next blocked worker's,
    # up to 4. (The first batch starts with what the first completions brought.)
    assert [len(c.scenario_ids) for c in backend.calls][1:] == [4, 4, 4]


@pytest.mark.parametrize("admission", ["eager", "staleness_aware"])
async def test_off_policy_bound_holds_under_load(model, autojump_clock, admission):
    backend = RecordingBackend(train_seconds=1.0)
    object.__setattr__(model, "_backend", backend)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(0.1 + (scenario["i"] * 7919 % 13) * 0.2)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(400), None, num_rollout_workers=16,
        min_batch_size=4, max_batch_size=4, max_steps_off_policy=1, max_steps=20,
        admission=admission,
    ).train(handle_signals=False)
    for call in backend.calls:
        for version in call.initial_versions:
            assert version is not None and version >= (call.step - 1) - 1
    await trio.lowlevel.checkpoint()


async def test_arts_tallies_persist_and_continue_across_a_resume(model, backend):
    """ART 0.5.20's accepted/discarded tallies in state.json add up over both runs."""

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] % 3 == 2:
            return art.TrajectoryGroup([trajectory(0.5), trajectory(0.5)])  # zero variance
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    def run(max_steps: int | None) -> PipelineTrainer[Any, Any]:
        return PipelineTrainer(
            model, backend, rollout, scenarios(18), None, num_rollout_workers=1,
            min_batch_size=2, max_batch_size=2, max_steps=max_steps,
        )

    await run(2).train(handle_signals=False)
    first = state_record(model)
    assert first["accepted_trainable_groups"] == 4
    await run(None).train(handle_signals=False)
    record = state_record(model)
    assert record["accepted_trainable_groups"] == 12 == len(
        [s for call in backend.calls for s in call.scenario_ids]
    )
    assert record["discarded_zero_variance_groups"] == 6
    assert record["discarded_stale_groups"] == 0
    if TRAIN_METRIC_NAMES == "0.5.23":  # a cumulative name only ART 0.5.20+ logs
        cum = [
            row["discarded/cum/zero_variance_groups"]
            for row in history(model)
            if "discarded/cum/zero_variance_groups" in row
        ]
        # The second run's rows continue from the first run's tally instead of restarting.
        assert cum == sorted(cum) and cum[2] >= first["discarded_zero_variance_groups"]


def state_record(model: Any) -> dict[str, Any]:
    state = json.loads((Path(model._get_output_dir()) / "state.json").read_text())
    record: dict[str, Any] = state["_pipeline_trainer"]
    return record
