"""The behaviour ART 0.5.23's own trainer tests check, checked on art_trio through `train()`.

ART's tests (tests/unit/test_pipeline_trainer_batching.py, test_pipeline_trainer_local_backend.py,
test_checkpoint_retention.py, test_track_api_cost.py, tests/integration/
test_pipeline_lifecycle_contract.py) call its trainer's private stages (`_rollout_worker`,
`_training_stage`, `_run_checkpoint_retention`) on a MagicMock backend. These are art_trio's
own tests of the same behaviour, reached through the public `train()` with the asyncio-only
backend double, under trio and under asyncio (anyio), on both ART lines where the behaviour
exists on both; a test of a 0.5.20+ behaviour skips on 0.5.18 with the reason. Each test
names the ART test it stands for.
"""

from __future__ import annotations

import asyncio
import functools
import json
import warnings
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio
from openai.types.chat.chat_completion import Choice

import art_trio
from art_trio import (
    CheckpointInfo,
    CheckpointRetentionContext,
    PipelineRuntimeConfig,
    PipelineTrainer,
    keep_recent_and_top,
    make_group_rollout_fn,
)
from art_trio.plumbing.compat import ART_0520, FATAL_ROLLOUT_ERRORS
from tests.doubles import RecordingBackend, trajectory

LOOPS = pytest.mark.parametrize("loop", ["trio", "asyncio"])
ONLY_0520 = pytest.mark.skipif(
    not ART_0520, reason="needs ART 0.5.20+ (Python 3.12+): ART 0.5.18 has no such behaviour"
)
ONE_AT_A_TIME = PipelineRuntimeConfig(num_rollout_workers=1, min_batch_size=1, max_batch_size=1)


def run(trainer: PipelineTrainer[Any, Any], loop: str) -> None:
    train = functools.partial(trainer.train, handle_signals=False)
    if loop == "trio":
        trio.run(train)
    else:
        anyio.run(train, backend="asyncio")


def trainer_for(
    model: art.TrainableModel,
    backend: Any,
    rollout: Any,
    scenario_list: list[Any],
    eval_fn: Any = None,
    **kwargs: Any,
) -> PipelineTrainer[Any, Any]:
    if not any(k in kwargs for k in ("num_rollout_workers", "min_batch_size")):
        kwargs.setdefault("pipeline", ONE_AT_A_TIME)
    return PipelineTrainer(model, backend, rollout, scenario_list, None, eval_fn, **kwargs)


def uses(backend: RecordingBackend, model: art.TrainableModel) -> RecordingBackend:
    object.__setattr__(model, "_backend", backend)
    return backend


async def two_rewards(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])


def history(model: art.TrainableModel) -> list[dict[str, Any]]:
    path = Path(model._get_output_dir()) / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoints(model: art.TrainableModel) -> list[int]:
    directory = Path(model._get_output_dir()) / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def served_choice(policy: int, *, tokens: int = 1, spans: bool = True) -> Choice:
    """A choice as ART 0.5.20+'s server returns it: its token count and which policy made it."""
    extra: dict[str, Any] = {"art_completion_tokens": tokens}
    if spans:
        extra["policy_token_spans"] = [
            {
                "start_token": 0,
                "end_token": tokens,
                "generation_id": f"g{policy}",
                "policy_version": policy,
                "lora_slot": "slot",
                "update_seq": 1,
            }
        ]
    return Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"},
         **extra}
    )


# -- test_pipeline_trainer_batching.py ------------------------------------------------------


@ONLY_0520
@LOOPS
def test_completion_tokens_are_recorded_on_every_returned_trajectory(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_local_pipeline_records_exact_choice_completion_tokens: a trajectory whose choice
    says it holds 3 tokens carries `completion_tokens == 3` when the backend trains it; the
    zero-variance group (never trained, logged as "discarded") carries it too."""
    returned: list[art.TrajectoryGroup] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        rewards = (1.0, 1.0) if scenario == "flat" else (0.0, 1.0)
        group = art.TrajectoryGroup(
            art.Trajectory(
                reward=r,
                messages_and_choices=[{"role": "user", "content": "q"}, served_choice(0, tokens=3)],
            )
            for r in rewards
        )
        returned.append(group)
        return group

    run(trainer_for(model, backend, rollout, ["flat", "signal"], max_steps=1), loop)
    [call] = backend.calls
    assert len(returned) == 2
    for group in returned:
        assert [t.metrics["completion_tokens"] for t in group.trajectories] == [3, 3]
    assert call.rewards == [[0.0, 1.0]]


@ONLY_0520
@LOOPS
def test_an_eval_of_another_policys_tokens_is_dropped(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_eval_rejects_tokens_from_another_policy: the eval of step 1 returns policy-0
    tokens, so step 1 has no val rows and no completed eval; step 0's eval (right policy, a
    prompt with earlier assistant turns: test_eval_ignores_historical_assistant_prompt_messages)
    is logged."""

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [
            art.Trajectory(
                reward=0.5,
                messages_and_choices=[
                    {"role": "user", "content": "earlier question"},
                    {"role": "assistant", "content": "earlier answer"},
                    {"role": "user", "content": "now"},
                    served_choice(0),  # always policy 0's tokens
                ],
            )
        ]

    run(trainer_for(model, backend, two_rewards, [0], eval_fn, eval_every_n_steps=1), loop)
    rows = history(model)
    assert [r["step"] for r in rows if "val/reward" in r] == [0]
    assert [r["step"] for r in rows if "checkpoint/eval_completed" in r] == [0]
    assert [c.step for c in backend.calls] == [1]


@ONLY_0520
@LOOPS
def test_once_spans_are_present_every_generated_choice_needs_them(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_eval_generated_choice_requires_provenance and
    test_eval_requires_at_least_one_generated_choice, where the eval carries spans: a choice
    without them, or a trajectory with no completion carrying them, drops the eval."""

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        annotated = art.Trajectory(
            reward=1.0,
            messages_and_choices=[{"role": "user", "content": "q"}, served_choice(step)],
        )
        if step == 0:
            bare = [{"role": "user", "content": "q"}, served_choice(step, spans=False)]
        else:
            bare = [{"role": "assistant", "content": "only prompt context"}]
        return [annotated, art.Trajectory(reward=0.0, messages_and_choices=bare)]

    run(trainer_for(model, backend, two_rewards, [0], eval_fn, eval_every_n_steps=1), loop)
    assert not [r for r in history(model) if "val/reward" in r]


@LOOPS
def test_an_eval_without_any_spans_is_logged(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """Deliberate difference: ART 0.5.20+ refuses every eval without `policy_token_spans`
    (test_eval_requires_at_least_one_generated_choice); art_trio logs one that carries none."""

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(step / 10)]

    run(trainer_for(model, backend, two_rewards, [0], eval_fn, eval_every_n_steps=1), loop)
    assert [r["step"] for r in history(model) if "val/reward" in r] == [0, 1]


@LOOPS
def test_a_batch_takes_at_most_max_batch_size_and_the_rest_trains_next(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_collect_batch_respects_max_batch_size: three groups wait while step 1 trains;
    with max_batch_size 2, step 2 takes two of them and step 3 the third."""
    training = asyncio.Event()

    async def rollout(model: Any, scenario: int, config: Any) -> art.TrajectoryGroup:
        if scenario > 0:
            await training.wait()  # done only once step 1 (scenario 0 alone) is training
        return await two_rewards(model, scenario, config)

    queued: list[Any] = []
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        training.set()
        if not backend.calls:
            for _ in range(100_000):  # until the three groups wait in the channel
                if len(queued) == 4:
                    break
                await asyncio.sleep(0)
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    trainer = trainer_for(
        model, backend, rollout, [0, 1, 2, 3],
        pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=1, max_batch_size=2),
    )
    trainer.add_observer(
        lambda event: queued.append(event) if type(event).__name__ == "GroupQueued" else None
    )
    run(trainer, loop)
    assert [len(c.scenario_ids) for c in backend.calls] == [1, 2, 1]


# -- test_pipeline_trainer_local_backend.py -------------------------------------------------


@LOOPS
def test_backend_train_gets_the_trainers_kwargs_as_art_passes_them(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_preserves_backend_train_kwargs (and, for LocalBackend,
    test_pipeline_trainer_uses_same_train_kwargs_for_local_backend: the same kwargs)."""
    loss_fn_config = {"alpha": 0.1}
    adam_params = object()
    run(
        trainer_for(
            model, backend, two_rewards, [0], learning_rate=2e-5, loss_fn="cispo",
            loss_fn_config=loss_fn_config, normalize_advantages=True, adam_params=adam_params,
        ),
        loop,
    )
    expected: dict[str, Any] = {
        "learning_rate": 2e-5,
        "loss_fn": "cispo",
        "loss_fn_config": loss_fn_config,
        "normalize_advantages": True,
        "save_checkpoint": False,
        "adam_params": adam_params,
    }
    if ART_0520:
        expected["optimizer_save_interval"] = 5
    assert backend.calls[0].kwargs == expected


@LOOPS
def test_a_kl_penalty_without_a_lag_uses_step_0_as_art_0523_does(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_forwards_default_kl_step_zero_for_generic_backend. On 0.5.18 no
    reference step is passed: that line's backends then use the base model."""
    run(trainer_for(model, backend, two_rewards, [0], kl_penalty_coef=0.25), loop)
    kwargs = backend.calls[0].kwargs
    assert kwargs["kl_penalty_coef"] == 0.25
    assert kwargs["kl_penalty_source"] == "sample"
    assert kwargs.get("kl_penalty_reference_step") == (0 if ART_0520 else None)


@LOOPS
@pytest.mark.parametrize(("start", "lag", "reference"), [(1, 5, 0), (3, 2, 1)])
def test_the_kl_reference_lags_the_step_trained_from(
    model: art.TrainableModel, loop: str, start: int, lag: int, reference: int
) -> None:
    """test_pipeline_trainer_kl_step_lag_floors_at_zero (step 1, lag 5: step 0) and
    test_pipeline_trainer_kl_step_lag_computes_reference (step 3, lag 2: step 1)."""
    backend = uses(RecordingBackend(step=start), model)
    run(
        trainer_for(
            model, backend, two_rewards, [0], kl_penalty_coef=0.25, kl_penalty_step_lag=lag
        ),
        loop,
    )
    assert [c.kwargs["kl_penalty_reference_step"] for c in backend.calls] == [reference]


def test_a_kl_lag_below_one_is_refused(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """test_pipeline_trainer_rejects_zero_kl_step_lag."""
    with pytest.raises(ValueError, match="kl_penalty_step_lag must be >= 1"):
        trainer_for(model, backend, two_rewards, [], kl_penalty_coef=0.25, kl_penalty_step_lag=0)


def keep_nothing_recorded(seen: list[list[int]]) -> Any:
    def strategy(context: CheckpointRetentionContext) -> set[int]:
        seen.append([c.step for c in context.checkpoints])
        return set()

    return strategy


def every_step_checkpointed(model: art.TrainableModel, backend: RecordingBackend) -> None:
    """Make the double leave a checkpoint at every step (and step 0's, as ART's backends
    create it at registration), so retention has something to decide over."""
    (Path(model._get_output_dir()) / "checkpoints" / "0000").mkdir(parents=True, exist_ok=True)
    record = backend.record

    def record_and_save(batch: Any) -> None:
        batch.kwargs["save_checkpoint"] = True
        record(batch)

    backend.record = record_and_save  # type: ignore[method-assign]


@LOOPS
@pytest.mark.parametrize(
    ("lag", "steps", "offered_last", "left"),
    [
        # test_pipeline_trainer_checkpoint_retention_protects_default_kl_reference
        (None, 3, [1, 2], [0, 3]),
        # test_pipeline_trainer_checkpoint_retention_protects_lagged_kl_reference
        (5, 6, [0], [1, 2, 3, 4, 5, 6]),
    ],
    ids=["default-reference", "lagged-reference"],
)
def test_retention_never_offers_or_deletes_the_kl_reference(
    model: art.TrainableModel,
    backend: RecordingBackend,
    loop: str,
    lag: int | None,
    steps: int,
    offered_last: list[int],
    left: list[int],
) -> None:
    every_step_checkpointed(model, backend)
    seen: list[list[int]] = []
    run(
        trainer_for(
            model, backend, two_rewards, list(range(steps)), max_steps=steps,
            kl_penalty_coef=0.25, kl_penalty_step_lag=lag,
            checkpoint_retention_strategy=keep_nothing_recorded(seen),
            # Once, at the last step, over every checkpoint (as ART's test sets them up).
            checkpoint_retention_interval=steps,
        ),
        loop,
    )
    assert seen == [offered_last]
    assert checkpoints(model) == left


@LOOPS
def test_retention_asks_nothing_while_the_lag_window_covers_every_checkpoint(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_checkpoint_retention_lag_warmup_protects_window."""
    every_step_checkpointed(model, backend)
    seen: list[list[int]] = []
    run(
        trainer_for(
            model, backend, two_rewards, list(range(4)), max_steps=4, kl_penalty_coef=0.25,
            kl_penalty_step_lag=5, checkpoint_retention_strategy=keep_nothing_recorded(seen),
        ),
        loop,
    )
    assert seen == []
    assert checkpoints(model) == [0, 1, 2, 3, 4]


@LOOPS
def test_retention_runs_only_on_its_interval(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_checkpoint_retention_honors_interval."""
    every_step_checkpointed(model, backend)
    seen: list[list[int]] = []
    run(
        trainer_for(
            model, backend, two_rewards, list(range(4)), max_steps=4,
            checkpoint_retention_strategy=keep_nothing_recorded(seen),
            checkpoint_retention_interval=5,
        ),
        loop,
    )
    assert seen == []
    assert backend.deleted_keep_lists == []


@LOOPS
def test_checkpoint_saved_and_eval_completed_rows_are_logged(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_logs_checkpoint_retention_metadata."""

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(0.5)]

    run(trainer_for(model, backend, two_rewards, [0], eval_fn, eval_every_n_steps=1), loop)
    rows = history(model)
    saved = [r for r in rows if "checkpoint/saved" in r]
    assert [(r["step"], r["checkpoint/saved"]) for r in saved] == [(1, 1.0)]
    assert saved[0]["checkpoint/created_at_unix"] > 0.0
    completed = [r["step"] for r in rows if r.get("checkpoint/eval_completed") == 1.0]
    assert completed == [0, 1]


# -- test_checkpoint_retention.py (the strategy itself; no event loop involved) --------------


def info(step: int, *, is_eval_step: bool = False, reward: float | None = None) -> CheckpointInfo:
    from datetime import UTC, datetime

    return CheckpointInfo(
        step=step,
        path=f"/checkpoints/{step:04d}",
        created_at=datetime.fromtimestamp(step, UTC),
        is_eval_step=is_eval_step,
        metrics={} if reward is None else {"val/reward": reward},
    )


def test_keep_recent_and_top_keeps_the_newest_and_the_best() -> None:
    """test_keep_recent_and_top_deletes_everything_else."""
    strategy = keep_recent_and_top(recent=2, top=1, metric="val/reward")
    context = CheckpointRetentionContext(
        current_step=6,
        checkpoints=[info(0), info(1, is_eval_step=True, reward=0.2), info(2),
                     info(3, is_eval_step=True, reward=0.8), info(4), info(5)],
    )
    assert set(strategy(context)) == {3, 4, 5}


def test_keep_recent_and_top_ranks_whatever_has_the_metric() -> None:
    """test_keep_recent_and_top_uses_metric_presence_for_legacy_history."""
    strategy = keep_recent_and_top(recent=0, top=1, metric="val/reward")
    context = CheckpointRetentionContext(
        current_step=3, checkpoints=[info(0), info(1, reward=0.9), info(2, reward=0.2)]
    )
    assert set(strategy(context)) == {1}


def test_keep_recent_and_top_with_zero_limits_keeps_nothing() -> None:
    """test_keep_recent_and_top_handles_zero_limits."""
    strategy = keep_recent_and_top(recent=0, top=0)
    context = CheckpointRetentionContext(
        current_step=3, checkpoints=[info(0), info(1), info(2)]
    )
    assert set(strategy(context)) == set()


@pytest.mark.parametrize(
    ("recent", "top", "match"), [(-1, 0, "recent must be >= 0"), (0, -1, "top must be >= 0")]
)
def test_keep_recent_and_top_refuses_negative_limits(recent: int, top: int, match: str) -> None:
    """test_keep_recent_and_top_rejects_negative_limits."""
    with pytest.raises(ValueError, match=match):
        keep_recent_and_top(recent=recent, top=top)


# -- test_track_api_cost.py (the trainer's part) ---------------------------------------------


@LOOPS
def test_rollouts_run_in_the_train_cost_context_and_evals_in_the_eval_one(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_pipeline_trainer_activates_train_context_for_rollouts and
    test_pipeline_trainer_activates_eval_context_for_eval_fn: what each callback sees, and an
    eval's tracked API cost logged under costs/eval/... with the eval's duration."""
    from art.metrics import MetricsBuilder, track_api_cost

    contexts: dict[str, list[str]] = {"rollout": [], "eval": []}

    class Usage:
        prompt_tokens, completion_tokens, prompt_tokens_details = 100, 50, None

    class Response:
        usage, model = Usage(), None

    @track_api_cost(
        source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1",
        prompt_price_per_million=1.0, completion_price_per_million=2.0,
    )
    async def judge() -> Response:
        return Response()

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        contexts["rollout"].append(MetricsBuilder.get_active().cost_context)
        return await two_rewards(model, scenario, config)

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        contexts["eval"].append(MetricsBuilder.get_active().cost_context)
        await judge()
        return [trajectory(1.0)]

    run(trainer_for(model, backend, rollout, [0], eval_fn, eval_every_n_steps=0), loop)
    assert contexts == {"rollout": ["train"], "eval": ["eval"]}
    [row] = [r for r in history(model) if "costs/eval/llm_judge/correctness" in r]
    assert row["costs/eval/llm_judge/correctness"] == pytest.approx(0.0002)
    assert any("time/step_eval_s" in r for r in history(model))


# -- tests/integration/test_pipeline_lifecycle_contract.py ------------------------------------


@LOOPS
def test_a_finite_source_is_rolled_out_and_trained_to_the_end(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """test_finite_source_drains_every_assigned_rollout: 4 workers, 5 scenarios, each rolled
    once, each group trained."""
    seen: list[int] = []

    async def rollout(model: Any, scenario: int, config: Any) -> art.TrajectoryGroup:
        seen.append(scenario)
        return art.TrajectoryGroup(
            [trajectory(float(k), metrics={"completion_tokens": 1}) for k in range(2)]
        )

    run(
        trainer_for(
            model, backend, rollout, list(range(5)),
            pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=1,
                                           max_batch_size=1),
        ),
        loop,
    )
    assert sorted(seen) == list(range(5))
    assert sum(len(c.scenario_ids) for c in backend.calls) == 5


def local_serving_unavailable(message: str) -> BaseException:
    [error_type] = FATAL_ROLLOUT_ERRORS
    return error_type(message)


def leaves(group: BaseException) -> Iterator[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        for exc in group.exceptions:
            yield from leaves(exc)
    else:
        yield group


@ONLY_0520
@LOOPS
@pytest.mark.parametrize("grouped", [False, True], ids=["rollout_fn", "make_group_rollout_fn"])
def test_local_serving_unavailable_stops_the_run_with_that_error(
    model: art.TrainableModel, backend: RecordingBackend, loop: str, grouped: bool
) -> None:
    """test_fatal_rollout_worker_failure_is_propagated: not one failed rollout among others,
    the end of the run (directly, and from one rollout of a group rollout). The scenario stays
    unresolved, so a resumed run rolls it again."""

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        raise local_serving_unavailable("runtime exited")

    async def single(model: Any, scenario: Any, config: Any) -> art.Trajectory:
        if scenario == 0:
            raise local_serving_unavailable("runtime exited")
        return trajectory(1.0)

    fn = make_group_rollout_fn(single, n=3) if grouped else rollout
    trainer = trainer_for(model, backend, fn, [0, 1, 2])
    with pytest.raises(BaseExceptionGroup) as caught:
        run(trainer, loop)
    [error] = [e for e in leaves(caught.value) if isinstance(e, FATAL_ROLLOUT_ERRORS)]
    assert "runtime exited" in str(error)
    assert trainer.last_counters is not None and trainer.last_counters.errored == 0
    assert backend.calls == []


@pytest.mark.skipif(
    not ART_0520, reason="needs ART 0.5.20+ (Python 3.12+) for LocalServingUnavailableError"
)
@pytest.mark.parametrize(
    "native", [False, True], ids=["asyncio single rollout", "trio_native single rollout"]
)
async def test_make_group_rollout_fn_re_raises_local_serving_unavailable(native: bool) -> None:
    """The group rollout itself (ART's make_group_rollout_fn raises it after gathering)."""
    calls: list[int] = []

    async def single(model: Any, scenario: Any, config: Any) -> art.Trajectory:
        calls.append(1)
        if len(calls) == 2:
            raise local_serving_unavailable("gone")
        return trajectory(1.0)

    fn = make_group_rollout_fn(art_trio.trio_native(single) if native else single, n=3)
    if native:
        with pytest.raises(FATAL_ROLLOUT_ERRORS, match="gone"):
            await fn(None, 0, None)
    else:
        import trio_asyncio

        async with trio_asyncio.open_loop():
            with pytest.raises(FATAL_ROLLOUT_ERRORS, match="gone"):
                await trio_asyncio.aio_as_trio(fn)(None, 0, None)
    assert len(calls) == 3  # every rollout of the group ran to its end first


def test_direct_runtime_kwargs_warn_on_0520_and_keep_the_old_defaults(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """test_deprecated_pipeline_kwargs_preserve_previous_defaults: min_batch_size=3 alone
    gives max_batch_size 30; ART 0.5.20+ warns (DeprecationWarning), 0.5.18 does not."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = PipelineTrainer(model, backend, two_rewards, [], None, min_batch_size=3)
        PipelineTrainer(model, backend, two_rewards, [], None, pipeline=ONE_AT_A_TIME)
    assert trainer.max_batch_size == 30
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == (1 if ART_0520 else 0)
    if ART_0520:
        assert "pipeline=PipelineRuntimeConfig(...)" in str(deprecations[0].message)
        assert deprecations[0].filename == __file__  # points at the caller, as ART's does


# -- leases set on the backend instance ------------------------------------------------------


@LOOPS
def test_leases_set_on_the_backend_instance_are_held(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    held: list[tuple[str, int]] = []

    def lease_of(kind: str) -> Any:
        @asynccontextmanager
        async def lease(model: Any, step: int) -> Any:
            asyncio.get_running_loop()
            held.append((kind, step))
            yield

        return lease

    backend.adapter_lease = lease_of("rollout")  # type: ignore[attr-defined]
    backend.exact_adapter_lease = lease_of("eval")  # type: ignore[attr-defined]

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(0.5)]

    run(trainer_for(model, backend, two_rewards, [0], eval_fn, eval_every_n_steps=1), loop)
    assert ("rollout", 0) in held
    assert [s for k, s in held if k == "eval"] == ([0, 1] if ART_0520 else [])
    if not ART_0520:
        assert [s for k, s in held if k == "rollout"] == [0, 0, 1]


@LOOPS
def test_a_batch_the_backend_prepares_nothing_in_is_not_trained(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """ART 0.5.23's packing stage: `prepare_pipeline_batch` returning None drops the batch
    (not trained); art_trio resolves its scenarios as zero variance and trains the next."""
    prepared: list[list[int]] = []

    async def prepare_pipeline_batch(
        model: Any, groups: list[art.TrajectoryGroup], **kwargs: Any
    ) -> dict[str, float] | None:
        asyncio.get_running_loop()
        prepared.append([len(g.trajectories) for g in groups])
        return None if len(prepared) == 1 else {"time/step_test_prepare_s": 0.5}

    backend.prepare_pipeline_batch = prepare_pipeline_batch  # type: ignore[attr-defined]
    trainer = trainer_for(model, backend, two_rewards, [0, 1, 2])
    run(trainer, loop)
    assert len(prepared) == 3
    assert [c.step for c in backend.calls] == [1, 2]
    counters = trainer.last_counters
    assert counters is not None and (counters.trained, counters.zero_variance) == (2, 1)
    train_rows = [r for r in history(model) if "train/reward" in r]
    assert all(any("test_prepare" in k for k in r) for r in train_rows) and train_rows
