"""Resume after a crash: kill -9 a training process mid-run, start it again, lose nothing.

The parent starts this same file as a child process that trains, waits until the child has
trained two steps, and kills it with SIGKILL (no ``finally``, no state saved on the way out).
It then builds a new trainer on the same model directory and calls ``train()`` again: the run
continues from the backend's last step, scenarios that were in flight or queued at the kill
are rolled again, and no scenario is trained twice (the per-step journal,
``art_trio/resume/``).

    python examples/resume_after_crash.py     # writes under ./.art
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402
import trio  # noqa: E402

from art_trio import (  # noqa: E402
    PipelineRuntimeConfig,
    PipelineTrainer,
    StepTrained,
    trainable_model,  # noqa: E402
)
from art_trio.demo import CpuBackend, TaskConfig, rollout, start_over  # noqa: E402
from art_trio.demo.task import build_prompts  # noqa: E402

NAME = "resume-after-crash"
TARGET_STEP = 5


def scenarios() -> Iterator[dict[str, Any]]:
    """A fixed, finite source: a resumed run must see the same scenarios in the same order."""
    for i, prompt in enumerate(build_prompts()):
        yield {"prompt": prompt, "seed": i, "metadata": {"scenario_id": f"s{i}"}}


async def quick_eval(model: art.TrainableModel, step: int, config: TaskConfig) -> list[Any]:
    """One question to ``model@step``. As in ART, a step is checkpointed when it is evaluated,
    and a resumed run starts from the newest checkpoint: evaluating every step keeps them all."""
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step), max_tokens=5,
        messages=[{"role": "user", "content": "respond with yes, no or maybe"}],
    )  # fmt: skip
    return [art.Trajectory(messages_and_choices=[response.choices[0]], reward=0.0)]


def trained_scenarios(model: art.TrainableModel) -> Counter[str]:
    """How often each scenario was trained, from what the observer below wrote per step."""
    counts: Counter[str] = Counter()
    for line in open(os.path.join(model._get_output_dir(), "trained_ids.txt")):
        counts.update(line.split())
    return counts


async def train(on_step: Any = None) -> art.TrainableModel:
    model: art.TrainableModel = trainable_model(name=NAME, project="examples",
                                                base_model="cpu-demo")  # fmt: skip
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)  # resumes from the newest checkpoint on disk
        trainer = PipelineTrainer(
            model, backend, rollout, scenarios(), TaskConfig(), quick_eval,
            pipeline=PipelineRuntimeConfig(
                num_rollout_workers=4, min_batch_size=2, max_batch_size=2),
            max_steps_off_policy=1,
            max_steps=TARGET_STEP - await backend._get_step(model), eval_every_n_steps=1,
            learning_rate=0.05,
        )  # fmt: skip
        record = os.path.join(model._get_output_dir(), "trained_ids.txt")

        def observe(event: object) -> None:
            if isinstance(event, StepTrained):
                with open(record, "a") as out:  # what each step trained, for the check below
                    out.write(" ".join(map(str, event.scenario_indices)) + "\n")
                if on_step is not None:
                    on_step(event.step)

        trainer.add_observer(observe)
        await trainer.train()
    return model


def child() -> None:
    trio.run(train, lambda step: print(f"step {step}", flush=True))


def parent() -> None:
    # Every run from step 0 (the model's directory has a fixed name); the crash and the
    # resume below then happen within this run.
    start_over(trainable_model(name=NAME, project="examples", base_model="cpu-demo"))
    process = subprocess.Popen([sys.executable, __file__, "--child"], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("step 2"):
            os.kill(process.pid, signal.SIGKILL)  # the crash: nothing runs after this
            break
    process.wait()
    print(f"killed the training process at step 2 (exit status {process.returncode})")

    model = trio.run(train)  # a new process would do the same: same name, same directory
    counts = trained_scenarios(model)
    print(f"resumed and trained to step {TARGET_STEP}: {len(counts)} scenarios trained, "
          f"none twice: {max(counts.values()) == 1}")  # fmt: skip
    assert max(counts.values()) == 1


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else parent()
