"""``art-trio demo --model smollm2``: ART's yes/no/maybe task on a real language model.

SmolLM2-135M-Instruct, asked ART's 48 prompts ("respond with yes, no, maybe", "just respond
with 'no' or 'yes'", ...), mostly chats instead of answering: about 1 answer in 8 starts with
yes, no or maybe, so the reward starts low but not at zero (first word maybe 1.0, no 0.75,
yes 0.5, anything else 0). Completions are capped at two tokens, which is all the reward
reads. The run trains a LoRA adapter with art_trio's ``PipelineTrainer`` through
``CPUBackend``'s real OpenAI-compatible server, prints progress, and draws the reward plot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import art

from art_trio import trainable_model
from art_trio.timeline.draw import many

from ..demo.task import Scenario, build_prompts, reward_for_answer
from ..demo.task import scenarios as _scenarios

PROJECT = "art-trio-demo"


@dataclass(frozen=True)
class LLMTaskConfig:
    """The ``config`` the trainer hands to ``rollout`` and ``eval_fn``."""

    group_size: int = 8
    max_tokens: int = 2
    #: Eval: this many of ART's prompts (spread over the 48), ``eval_samples`` answers each.
    eval_prompts: int = 12
    eval_samples: int = 4
    seed: int = 0
    verbose: bool = False
    #: ``time.monotonic()`` at the run's start: verbose val lines then say the time elapsed.
    started: float | None = None
    #: The answer's score: other single-turn tasks on ART's prompts (``art_trio.cpu.tasks``)
    #: change only this and ``max_tokens``.
    score: Callable[[str], float] = reward_for_answer


def scenarios(seed: int = 0) -> Iterator[Scenario]:
    """ART's prompts, reshuffled each epoch (the numpy demo's stream)."""
    return _scenarios(seed)


def eval_prompt_list(config: LLMTaskConfig) -> list[str]:
    prompts = build_prompts()
    stride = max(1, len(prompts) // max(1, config.eval_prompts))
    return prompts[::stride][: config.eval_prompts]


async def rollout(
    model: art.TrainableModel, scenario: Scenario, config: LLMTaskConfig
) -> art.TrajectoryGroup:
    """One request, ``n=group_size`` answers from the newest policy, with logprobs."""
    messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),  # the newest step (the in-flight slot, if on)
        messages=messages,
        n=config.group_size,
        max_tokens=config.max_tokens,
        logprobs=True,
        seed=scenario["seed"],
    )
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=config.score(choice.message.content or ""),
        )
        for choice in response.choices
    )


async def eval_fn(
    model: art.TrainableModel, step: int, config: LLMTaskConfig
) -> list[art.Trajectory | art.TrajectoryGroup]:
    """The eval prompts from ``model@step`` with fixed seeds: a step's val reward depends
    only on its weights."""
    client = model.openai_client()

    async def answers(index: int, prompt: str) -> list[art.Trajectory]:
        messages: art.Messages = [{"role": "user", "content": prompt}]
        response = await client.chat.completions.create(
            model=model.get_inference_name(step),
            messages=messages,
            n=config.eval_samples,
            max_tokens=config.max_tokens,
            seed=config.seed * 1_000_003 + 7919 * index + 1,
        )
        return [
            art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward=config.score(choice.message.content or ""),
            )
            for choice in response.choices
        ]

    # All prompts at once: the server samples one request at a time, so sent one after the
    # other each would queue behind the rollouts' requests and the eval would finish steps
    # late (measured: step 0's val reward came after step 6 with 2 rollout workers).
    per_prompt = await asyncio.gather(
        *(answers(index, prompt) for index, prompt in enumerate(eval_prompt_list(config)))
    )
    trajectories: list[art.Trajectory | art.TrajectoryGroup] = [
        t for group in per_prompt for t in group
    ]
    report_val_reward(config, step, trajectories)
    return trajectories


def report_val_reward(
    config: Any, step: int, trajectories: list[art.Trajectory | art.TrajectoryGroup]
) -> None:
    """Print a step's mean val reward (and the seconds since `config.started`) where the
    task's `config.verbose` asks for it: every task's eval says it the same way."""
    if not config.verbose:
        return
    mean = sum(t.reward for t in trajectories if isinstance(t, art.Trajectory))
    elapsed = (
        "" if config.started is None else f" ({time.monotonic() - config.started:.0f} s elapsed)"
    )
    print(
        f"  val reward at step {step}: {mean / max(1, len(trajectories)):.3f}{elapsed}", flush=True
    )


@dataclass(frozen=True)
class LLMDemoOptions:
    model: str | None = None  # None / "smollm2": the default GGUF
    #: A name from ``art_trio.cpu.tasks.TASKS`` (``--task``): "yes-no-maybe", "lookup", ...
    task: str = "yes-no-maybe"
    # Measured: val reward 0.057 at step 0 -> 0.750 at step 5 (seed 0). By then most groups
    # answer alike (zero variance, nothing to learn from), so more steps come slowly.
    steps: int = 6
    workers: int = 2
    seed: int = 0
    group_size: int | None = None  # None: the task's own
    learning_rate: float = 2e-3
    loss_fn: str = "cispo"
    min_batch_size: int = 2
    max_steps_off_policy: int = 1
    eval_every: int = 3
    eval_prompts: int = 12
    eval_samples: int = 4
    output_dir: Path = Path(".")
    name: str | None = None
    plot: bool = True


async def run_llm_demo(options: LLMDemoOptions, task: Any) -> Any:
    """Run the real-model demo of ``task`` (an ``art_trio.cpu.tasks.LLMTask``, which builds
    on this module's yes/no/maybe task: handed in, so the two import in one direction);
    returns the numpy demo's ``DemoResult`` shape."""
    from art_trio import PipelineTrainer, StepTrained

    from ..demo.cli import DemoResult
    from ..demo.interrupt import run_interruptibly
    from ..demo.plot import plot_rewards, read_rewards
    from .backend import CPUBackend

    started = time.monotonic()
    group_size = options.group_size or task.group_size
    name = options.name or f"smollm2-{task.name}-{datetime.now():%Y%m%d-%H%M%S}"
    model = trainable_model(
        name=name,
        project=PROJECT,
        base_model=options.model or "smollm2",
        base_path=str(options.output_dir / ".art"),
    )
    config = task.config(
        group_size=group_size,
        eval_prompts=options.eval_prompts,
        eval_samples=options.eval_samples,
        seed=options.seed,
        verbose=True,
        started=started,
    )
    backend = CPUBackend(options.model, seed=options.seed)
    # The first load converts the GGUF (minutes): in a thread, so that Ctrl-C is answered.
    await run_interruptibly(
        backend._load, what="the model load", announce=f"Loading {backend.source.path} ..."
    )
    async with backend:
        print(f"Model loaded in {time.monotonic() - started:.0f} s", flush=True)
        await model.register(backend)
        start_step = await backend._get_step(model)
        print(
            f"Training {name!r}: {many(options.steps, 'step')} from step {start_step}, "
            f"task {task.name!r}, {many(options.workers, 'rollout worker')}, "
            f"groups of {group_size}, "
            f"{options.min_batch_size} groups per step; served at {backend.base_url}",
            flush=True,
        )
        trainer = PipelineTrainer(
            model,
            backend,
            task.rollout,
            task.scenarios(options.seed),
            config,
            task.eval_fn,
            num_rollout_workers=options.workers,
            min_batch_size=options.min_batch_size,
            max_batch_size=options.min_batch_size,
            max_steps_off_policy=options.max_steps_off_policy,
            learning_rate=options.learning_rate,
            loss_fn=options.loss_fn,
            max_steps=options.steps,
            eval_every_n_steps=options.eval_every,
            log_interval_seconds=30.0,
        )

        def progress(event: object) -> None:
            if isinstance(event, StepTrained):
                reward = "" if event.reward_mean is None else f" (reward {event.reward_mean:.3f})"
                print(
                    f"step {event.step}: {event.batch_size} groups{reward}, step took "
                    f"{event.wall_s:.1f} s ({event.train_s:.1f} s training); "
                    f"{time.monotonic() - started:.0f} s elapsed",
                    flush=True,
                )

        trainer.add_observer(progress)
        await trainer.train(handle_signals=True)
        final_step = await backend._get_step(model)
    wall_seconds = time.monotonic() - started
    stop_signal = trainer.stop_signal
    history_path = Path(model._get_output_dir()) / "history.jsonl"
    vals = read_rewards(history_path)["val/reward"] if history_path.exists() else []
    plot_path = None
    if options.plot and history_path.exists():
        plot_path = plot_rewards(
            history_path,
            Path(model._get_output_dir()) / "reward.png",
            title=f"{name}: SmolLM2-135M, {task.name} on a CPU (seed {options.seed})",
        )
    return DemoResult(
        name=name,
        start_step=start_step,
        final_step=final_step,
        wall_seconds=wall_seconds,
        first_val=vals[0] if vals else None,
        last_val=vals[-1] if vals else None,
        history_path=history_path,
        plot_path=plot_path,
        stop_signal=stop_signal,
    )
