"""The CPU demo's ART backend: registration, real policy-gradient training, versioned serving,
checkpoints and resume, driven by hand (no trainer) with a real ``art.TrainableModel``."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import trio  # noqa: E402
import trio_asyncio  # noqa: E402
from art.types import LocalTrainResult  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402
from openai.types.chat.chat_completion_message import ChatCompletionMessage  # noqa: E402

from art_trio.demo.backend import CpuBackend  # noqa: E402
from art_trio.demo.policy import (  # noqa: E402
    TOKEN_INDEX,
    VOCAB,
    LossFn,
    Sample,
    featurize,
    group_advantages,
    initial_weights,
    log_probs,
    policy_gradient,
)
from art_trio.demo.task import (  # noqa: E402
    TaskConfig,
    build_prompts,
    eval_fn,
    reward_for_answer,
    rollout,
    scenarios,
)
from art_trio.plumbing.compat import trainable_model
from tests.loops import require_trio_asyncio_patched_anyio

T = TypeVar("T")
PROMPT = "just respond with 'no' or 'yes'"


def make_model(tmp_path: Path, name: str = "demo") -> art.TrainableModel:
    return trainable_model(
        name=name, project="backend-tests", base_model="cpu-demo", base_path=str(tmp_path)
    )


async def aio(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Run ART-style asyncio code (rollout, eval, backend calls) from this trio test, the way
    the trainer does: through trio-asyncio (the caller has a loop open)."""
    return await trio_asyncio.aio_as_trio(fn)(*args, **kwargs)


async def val_reward(model: art.TrainableModel, step: int, config: TaskConfig) -> float:
    trajectories = await aio(eval_fn, model, step, config)
    rewards = [t.reward for t in trajectories if isinstance(t, art.Trajectory)]
    assert len(rewards) == len(trajectories) == 48 * config.eval_samples
    return sum(rewards) / len(rewards)


async def maybe_logprob(model: art.TrainableModel, step: int) -> float:
    """logprob of "maybe" as served for ``model@step``, read from a real response."""
    client = openai.AsyncOpenAI(
        base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0
    )
    async with client:
        response = await client.chat.completions.create(
            model=model.get_inference_name(step),
            messages=[{"role": "user", "content": PROMPT}],
            logprobs=True,
            top_logprobs=len(VOCAB),
        )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    return next(t.logprob for t in content[0].top_logprobs if t.token == "maybe")


def maybe_group(n_maybe: int = 4, n_yes: int = 4) -> art.TrajectoryGroup:
    """A group where "maybe" beat "yes", with no logprobs (trained as on-policy)."""
    messages: art.Messages = [{"role": "user", "content": PROMPT}]

    def trajectory(word: str) -> art.Trajectory:
        choice = Choice(
            index=0,
            finish_reason="stop",
            message=ChatCompletionMessage(role="assistant", content=word),
        )
        return art.Trajectory(
            messages_and_choices=[*messages, choice], reward=reward_for_answer(word)
        )

    return art.TrajectoryGroup(
        [trajectory("maybe") for _ in range(n_maybe)] + [trajectory("yes") for _ in range(n_yes)]
    )


# --------------------------------------------------------------------------- the policy


def test_initial_policy_is_near_uniform_over_the_three_answers() -> None:
    weights = initial_weights(seed=0)
    expected = []
    for prompt in build_prompts():
        probs = np.exp(log_probs(weights, featurize(prompt)))
        expected.append(sum(p * reward_for_answer(w) for p, w in zip(probs, VOCAB, strict=True)))
        assert probs[[TOKEN_INDEX[w] for w in VOCAB[3:]]].sum() < 0.05
    assert 0.70 <= float(np.mean(expected)) <= 0.78


def test_group_advantages_match_art() -> None:
    assert group_advantages([1.0, 0.5]) == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group_advantages([1.0, 0.5], normalize=False) == pytest.approx([0.25, -0.25])
    assert group_advantages([0.75, 0.75]) == [0.0, 0.0]


@pytest.mark.parametrize("loss_fn", ["cispo", "ppo"])
def test_gradient_step_raises_the_advantaged_token(loss_fn: LossFn) -> None:
    weights = initial_weights(seed=3)
    x = featurize(PROMPT)
    before = log_probs(weights, x)[TOKEN_INDEX["maybe"]]
    samples = [Sample(x, TOKEN_INDEX["maybe"], 1.0), Sample(x, TOKEN_INDEX["yes"], -1.0)]
    result = policy_gradient(weights, samples, loss_fn=loss_fn)
    after = log_probs(weights - 0.1 * result.grad, x)[TOKEN_INDEX["maybe"]]
    assert after > before
    assert result.metrics["importance_ratio"] == pytest.approx(1.0)
    assert result.metrics["grad_norm"] > 0


def test_ppo_clips_and_cispo_truncates_the_importance_ratio() -> None:
    weights = initial_weights(seed=0)
    x = featurize(PROMPT)
    now = float(log_probs(weights, x)[TOKEN_INDEX["maybe"]])
    # Sampled when "maybe" was far less likely: the ratio is e^2, about 7.4.
    stale = [Sample(x, TOKEN_INDEX["maybe"], 1.0, old_logprob=now - 2.0)]
    ppo = policy_gradient(weights, stale, loss_fn="ppo")
    assert ppo.metrics["frac_clipped"] == 1.0
    assert ppo.metrics["grad_norm"] == 0.0  # positive advantage, ratio above 1 + eps: no step
    cispo = policy_gradient(weights, stale, loss_fn="cispo")
    on_policy = policy_gradient(weights, [Sample(x, TOKEN_INDEX["maybe"], 1.0)], loss_fn="cispo")
    # CISPO still steps, with the weight truncated at 1 + eps_high = 5.
    assert cispo.grad == pytest.approx(5.0 * on_policy.grad)
    with pytest.raises(ValueError):
        policy_gradient(weights, stale, loss_fn=cast(LossFn, "grpo"))


# --------------------------------------------------------------------------- the backend


async def test_register_prepares_serving_and_step_zero_checkpoint(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        assert model.inference_base_url == backend.base_url
        assert model.inference_base_url.endswith("/v1")
        assert model.inference_api_key == backend.api_key
        assert await model.get_step() == 0
        assert model.get_inference_name() == "demo@0"
        assert backend._model_inference_name(model, step=3) == "demo@3"
        checkpoint = Path(model._get_output_dir()) / "checkpoints" / "0000" / "weights.npz"
        assert checkpoint.is_file()


async def test_train_returns_art_result_and_checkpoints_when_asked(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        # ART's trainer calls train from asyncio code: do the same, through trio-asyncio,
        # with every keyword argument the trainer passes.
        async with trio_asyncio.open_loop():
            first = await aio(
                backend.train,
                model,
                [maybe_group()],
                learning_rate=0.1,
                loss_fn="cispo",
                loss_fn_config=None,
                normalize_advantages=True,
                save_checkpoint=False,
                adam_params=None,
                packed_sequence_length=None,
                kl_penalty_coef=0.0,
            )
        assert isinstance(first, LocalTrainResult)
        assert first.step == 1 and first.checkpoint_path is None
        assert {"loss", "grad_norm"} <= set(first.metrics)
        assert first.metrics["num_trained_tokens"] == 8
        second = await backend.train(model, [maybe_group()], learning_rate=0.1, loss_fn="ppo")
        assert second.step == 2
        assert second.checkpoint_path is not None
        assert await trio.Path(second.checkpoint_path, "weights.npz").is_file()
        assert Path(second.checkpoint_path).name == "0002"
        assert await model.get_step() == 2
        assert model.get_inference_name() == "demo@2"
        with pytest.raises(ValueError):
            await backend.train(model, [maybe_group()], loss_fn="dpo")


async def test_old_step_is_still_served_while_newer_steps_train(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        step0_before = await maybe_logprob(model, 0)
        for _ in range(2):
            await backend.train(model, [maybe_group()], learning_rate=0.2, save_checkpoint=False)
        # model@0 answers with step 0's weights, bit for bit; model@2 has learned.
        assert await maybe_logprob(model, 0) == step0_before
        assert await maybe_logprob(model, 2) > step0_before + 0.1
        assert await maybe_logprob(model, 1) > step0_before
        # And a seeded request to model@0 repeats exactly.
        client = model.openai_client()

        async def answers(name: str) -> list[str | None]:
            response = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": PROMPT}], n=32, seed=7
            )
            return [c.message.content for c in response.choices]

        assert await answers("demo@0") == await answers("demo@0")
        assert (await answers("demo@2")).count("maybe") > (await answers("demo@0")).count("maybe")
        await client.close()


async def test_eviction_keeps_recent_leased_and_checkpointed_steps(tmp_path: Path) -> None:
    async with CpuBackend(seed=0, keep_steps=2) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        lease = backend.adapter_lease(model, 1)
        await backend.train(model, [maybe_group()], save_checkpoint=False)  # step 1
        async with lease:
            for _ in range(3):  # steps 2, 3, 4
                await backend.train(model, [maybe_group()], save_checkpoint=False)
            # Leased: still served although older than the two newest.
            await maybe_logprob(model, 1)
            assert "demo@1" in backend.model_names()
        assert backend.model_names() == ["demo@3", "demo@4"]
        with pytest.raises(openai.NotFoundError):
            await maybe_logprob(model, 1)  # evicted, never saved
        with pytest.raises(openai.NotFoundError):
            await maybe_logprob(model, 2)
        with pytest.raises(openai.NotFoundError):
            await maybe_logprob(model, 5)  # not trained yet
        # Step 0 was evicted from memory but has a checkpoint: reloaded, same weights.
        assert await maybe_logprob(model, 0) == pytest.approx(
            float(log_probs(initial_weights(0), featurize(PROMPT))[TOKEN_INDEX["maybe"]])
        )


async def test_delete_checkpoint_files_keeps_only_listed_steps(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        for _ in range(3):
            await backend.train(model, [maybe_group()], save_checkpoint=True)
        root = Path(model._get_output_dir()) / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["0000", "0001", "0002", "0003"]
        await backend._delete_checkpoint_files(model, [0, 3])
        assert sorted(p.name for p in root.iterdir()) == ["0000", "0003"]
        # Deleting files does not stop serving what is in memory.
        await maybe_logprob(model, 2)


async def test_register_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        for save in (True, True, False):
            await backend.train(model, [maybe_group()], learning_rate=0.1, save_checkpoint=save)
        saved = await maybe_logprob(model, 2)
    async with CpuBackend(seed=99) as backend:
        resumed = make_model(tmp_path)
        await resumed.register(backend)
        # Step 3 was never saved: the run resumes from step 2, with step 2's weights.
        assert await resumed.get_step() == 2
        assert resumed.get_inference_name() == "demo@2"
        assert await maybe_logprob(resumed, 2) == pytest.approx(saved)
        result = await backend.train(resumed, [maybe_group()], learning_rate=0.1)
        assert result.step == 3


async def test_short_training_run_raises_reward(tmp_path: Path) -> None:
    """Rollouts from the served policy, trained with cispo, for 12 steps: deterministic for
    the seed, and clearly better (the optimum is 1.0, the start about 0.75)."""
    require_trio_asyncio_patched_anyio()
    config = TaskConfig(group_size=8, eval_samples=4, seed=0)

    async def run(loss_fn: str, path: Path) -> tuple[float, float]:
        async with CpuBackend(seed=0) as backend, trio_asyncio.open_loop():
            model = make_model(path)
            await aio(model.register, backend)
            before = await val_reward(model, 0, config)
            stream = scenarios(seed=0)
            for _ in range(12):
                groups = [await aio(rollout, model, next(stream), config) for _ in range(4)]
                # The rollouts asked for logprobs: train uses them as the sampling policy.
                choice = groups[0].trajectories[0].messages_and_choices[-1]
                assert isinstance(choice, Choice) and choice.logprobs is not None
                await aio(
                    backend.train,
                    model,
                    groups,
                    learning_rate=0.05,
                    loss_fn=loss_fn,
                    save_checkpoint=False,
                )
            after = await val_reward(model, 12, config)
            await aio(model.openai_client().close)
        return before, after

    before, after = await run("cispo", tmp_path / "a")
    assert 0.7 <= before <= 0.8
    assert after >= 0.9
    assert after - before >= 0.15
    # Same seed, same run.
    assert await run("cispo", tmp_path / "b") == (before, after)
    _, ppo_after = await run("ppo", tmp_path / "c")
    assert ppo_after >= before + 0.1
