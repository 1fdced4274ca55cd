"""Drive the real `PipelineTrainer` under trio's MockClock and record what its doubles saw.

Part of the property suite for users (see :mod:`art_trio.testing.pipeline` for the short way
in, and docs/property-testing.md); the repository's own property_tests/ run on it too.

One `Case` (a configuration, one `RolloutPlan` per scenario, training and eval durations and
an optional stop time) is run by `run_case` (or `run_resume_case`: stop, then resume with a
new trainer on the same model directory and backend). Every example gets a fresh model
directory and a fresh `trio.run` with `MockClock(autojump_threshold=0)`, so hours of virtual
training take milliseconds and a run depends on nothing but its case.

What is recorded comes from the outside of the trainer, so the invariants in `checks.py`
count independently of the trainer's own counters:

- the rollout double (trio-native) logs each call: scenario, start, how it ended (returned a
  group / zero-variance group / wrong type / NaN reward, raised, or was cancelled), and
  whether a stop had been requested when it returned;
- the backend double (asyncio code, reached through trio-asyncio like a real ART backend)
  logs each `train` call: step produced, scenario ids, initial and final policy versions;
- the eval double logs start and end of each eval (to see two at once);
- the trainer's public events (`trainer.add_observer`): the groups the trainer took out of
  the channel, with the channel's occupancy just before each receive and what was left at
  close (together its exact maximum, since only sends grow the buffer), and each published
  policy version, and the stall watchdog's reports; `trainer.statistics()` after the run
  gives the channel's capacity and whether the run stopped as collapsed. Nothing inside the
  trainer is patched.

`model.log` stays ART's real one (parquet + history.jsonl + state.json writes): it costs about
2 ms a step here, and keeping it means the trainer's state mirror in ART's `state.json` is
exercised against ART's own rewrites of that file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import anyio  # noqa: E402
import art  # noqa: E402
import trio  # noqa: E402
import trio.testing  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402

from art_trio import (  # noqa: E402
    ChannelClosed,
    GroupReceived,
    PipelineSettings,
    PipelineTrainer,
    PolicyPublished,
    RunEvent,
    Stalled,
    trainable_model,
    trio_native,
)
from art_trio.config.keywords import resolve_settings  # noqa: E402
from art_trio.plumbing.bridge.calls import call_asyncio_from_trio, is_native  # noqa: E402
from art_trio.resume.state import PipelineState  # noqa: E402
from art_trio.resume.store import StateStore  # noqa: E402
from art_trio.testing.doubles import BackendDouble as SharedBackendDouble  # noqa: E402
from art_trio.testing.doubles import (  # noqa: E402
    EvalCall,
    EvalDouble,
    TrainBatch,
    group_initial_version,
    trajectory,
)

#: Failure kinds a rollout plan can ask for.
#: - "raise": the rollout raises; "wrong_type": it returns a dict, not a TrajectoryGroup;
#: - "nan": one reward is NaN (art_trio rejects the group as errored);
#: - "partial": some rollouts of the group raised, the rest are trajectories (a normal group);
#: - "all_failed": every rollout raised: a group with no trajectories, which makes the trainer
#:   raise RuntimeError (ART's behaviour) when it receives it;
#: - "tokens_inf", "tokens_nan", "tokens_negative": one trajectory's `completion_tokens` is
#:   inf, NaN or -3 (art_trio rejects the group as errored: no weight can stand for it).
FAILURE_KINDS = (
    "raise", "wrong_type", "nan", "partial", "all_failed", "tokens_inf", "tokens_nan",
    "tokens_negative",
)
#: The bad `completion_tokens` of each "tokens_*" failure.
BAD_TOKEN_COUNTS = {"tokens_inf": math.inf, "tokens_nan": math.nan, "tokens_negative": -3}
#: Failures that count as `errored`.
ERROR_KINDS = frozenset({"raise", "wrong_type", "nan", *BAD_TOKEN_COUNTS})

#: How many generated scenarios a check uses when it is given no source.
DEFAULT_SCENARIOS = 24


class PlannedRolloutError(Exception):
    """What a rollout planned to fail raises."""


# -- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutPlan:
    """What the rollout of one scenario does: how long it takes and what it returns."""

    latency: float
    rewards: tuple[float, ...]
    failure: str | None = None
    #: > 0: the group's first trajectory claims `initial_policy_version` this many versions
    #: ahead of the trainer's policy when it returns (replayed; the run must stop).
    future_by: int = 0
    #: With in-flight updates (`Config.in_flight_updates`): the latency is decoded in
    #: `len(tokens)` equal chunks, chunk i producing `tokens[i]` tokens under the backend's
    #: step when it begins (see `make_rollout_fn`).
    tokens: tuple[int, ...] = (4,)

    @property
    def zero_variance(self) -> bool:
        """The trainer's rule, restated: one trajectory or fewer, or all rewards equal."""
        return len(self.rewards) <= 1 or len(set(self.rewards)) == 1

    @property
    def usable(self) -> bool:
        """Returns a group the trainer may keep (not errored, not all-failed)."""
        return self.failure in (None, "partial")


@dataclass(frozen=True)
class Config:
    """The trainer parameters the properties vary."""

    num_rollout_workers: int = 2
    min_batch_size: int = 1
    max_batch_size: int = 2
    max_steps_off_policy: int | None = 1
    #: ART 0.5.20's mean policy-age bound (None: off).
    limit_mean_steps_off_policy: float | None = None
    queue_maxsize: int | None = None
    max_steps: int | None = None
    eval_every_n_steps: int = 0
    eval_at_start: bool = False
    discard_queue_multiplier: int = 100
    admission: str = "staleness_aware"
    shutdown_grace_seconds: float | None = 5.0
    max_rollouts_beyond_bound: int | None = None
    #: Any other `PipelineTrainer` keyword arguments (name, value), passed through unchecked
    #: by the invariants (learning rate, loss, ...).
    extra: tuple[tuple[str, Any], ...] = ()
    #: The backend updates weights under running rollouts: rollouts report per-token policy
    #: versions (`policy_token_spans`). A backend property, not a trainer setting.
    in_flight_updates: bool = False

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Config:
        """The configuration a user's `PipelineTrainer(**settings)` keyword arguments give.

        Names the invariants read take `settings`' value, else `PipelineSettings`' default
        (the trainer's own); every other keyword goes to `extra`, so the trainer still gets
        it (and rejects what it does not know, with its own message).
        """
        own = {f for f in cls.__dataclass_fields__ if f not in ("extra", "in_flight_updates")}
        group_of = _group_of_each_setting()
        groups = set(group_of.values())
        resolved = _resolved(settings, group_of)
        values: dict[str, Any] = {name: resolved.get(name) for name in sorted(own)}
        given = set(settings) | {name for name, group in group_of.items() if group in settings}
        # Settings the invariants do not read, as the trainer resolved them (a group given
        # whole spelt out flat), then the trainer's other keywords as given.
        extra = tuple(
            (k, v) for k, v in resolved.flat().items() if k not in own and k in given
        ) + tuple(
            (k, v) for k, v in settings.items()
            if k not in group_of and k not in groups and k not in ("pipeline", "eval_step_0")
        )
        return cls(**values, extra=extra)

    def kwargs(self) -> dict[str, Any]:
        return dict(self.extra) | {
            "num_rollout_workers": self.num_rollout_workers,
            "min_batch_size": self.min_batch_size,
            "max_batch_size": self.max_batch_size,
            "max_steps_off_policy": self.max_steps_off_policy,
            "limit_mean_steps_off_policy": self.limit_mean_steps_off_policy,
            "queue_maxsize": self.queue_maxsize,
            "max_steps": self.max_steps,
            "eval_every_n_steps": self.eval_every_n_steps,
            "eval_at_start": self.eval_at_start,
            "discard_queue_multiplier": self.discard_queue_multiplier,
            "admission": self.admission,
            "shutdown_grace_seconds": self.shutdown_grace_seconds,
            "max_rollouts_beyond_bound": self.max_rollouts_beyond_bound,
        }

    @property
    def channel_capacity(self) -> int:
        """The reference's groups-queue size, restated independently of art_trio's settings."""
        if self.queue_maxsize is not None:
            return self.queue_maxsize
        # ART 0.5.20: the hard bound, else the mean bound rounded up, else one step.
        m, mean = self.max_steps_off_policy, self.limit_mean_steps_off_policy
        window = m if m is not None else math.ceil(mean) if mean is not None else 1
        return max(1, window * self.max_batch_size)

    def too_old(
        self, version: int | None, step: int, tokens: Sequence[tuple[int, int]] = ()
    ) -> bool:
        """The reference's staleness rule, restated: a group started at `version` is too old
        for the batch trained from `step`. Its token-weighted mean age is reckoned from
        `tokens`, (policy version, tokens) of its served spans, where it has any (in-flight
        updates), else every token is aged `step - version`."""
        if version is None:
            return False
        m, mean = self.max_steps_off_policy, self.limit_mean_steps_off_policy
        hard_stale = m is not None and version < step - m
        age: float = step - version
        if sum(n for _, n in tokens) > 0:
            age = sum((step - v) * n for v, n in tokens) / sum(n for _, n in tokens)
        return hard_stale or (mean is not None and age > mean)

    @property
    def discard_limit(self) -> int:
        return self.discard_queue_multiplier * self.min_batch_size

def _group_of_each_setting() -> dict[str, str]:
    """Each flat setting's name -> the `PipelineSettings` group it is declared in."""
    defaults = PipelineSettings()
    return {
        name.name: group.name
        for group in dataclasses.fields(PipelineSettings)
        for name in dataclasses.fields(getattr(defaults, group.name))
    }


def _resolved(settings: Mapping[str, Any], group_of: Mapping[str, str]) -> PipelineSettings:
    """`settings` read by the trainer's own rule (flat names, groups given whole, `pipeline=`,
    `eval_step_0`): the invariants then read what the trainer will run."""
    groups = set(group_of.values())
    spelled = {k: v for k, v in settings.items() if k in group_of or k in groups}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the trainer warns itself
        return resolve_settings(
            spelled, pipeline=settings.get("pipeline"), autotune=None,
            rollout_executor=None, eval_step_0=bool(settings.get("eval_step_0", True)),
        )


@dataclass(frozen=True)
class Resize:
    """One `trainer.resize` call: the worker count, and maybe new batch and queue sizes."""

    at: float
    num_rollout_workers: int
    #: None: unchanged (min and max are drawn together, min <= max).
    batch_sizes: tuple[int, int] | None = None
    queue_maxsize: int | None = None


@dataclass(frozen=True)
class Sizes:
    """The sizes in force from virtual time `since` on (in one run)."""

    since: float
    min_batch_size: int
    max_batch_size: int
    channel_capacity: int


@dataclass(frozen=True)
class Case:
    """One generated scenario: a configuration and everything the doubles will do."""

    config: Config
    plans: tuple[RolloutPlan, ...]
    train_seconds: tuple[float, ...] = (1.0,)
    #: None: no eval_fn. Otherwise eval durations, cycled over the evals.
    eval_seconds: tuple[float, ...] | None = None
    #: Virtual time at which `request_stop()` is called (None: never).
    stop_at: float | None = None
    #: For resume cases: when the second run is stopped (None: it runs to its end).
    second_stop_at: float | None = None
    #: `request_stop(force=True)` from inside the first run's `backend.train` call that
    #: would produce this step (None: never).
    force_stop_in_train: int | None = None
    #: Live resizes, applied by `trainer.resize` in each run at their virtual time (one due
    #: before `train()` starts or after it ends changes the settings only).
    resizes: tuple[Resize, ...] = ()
    #: The user's scenarios, one per plan (None: generated ones). The trainer's source is
    #: these, each wrapped with its index (`{"metadata": {"scenario_id": i}, "scenario": s}`).
    scenarios: tuple[Any, ...] | None = None
    #: The user's rollout function (None: the plan's rewards make the group). Called after
    #: the plan's latency (virtual time) with the model, the user's scenario and the config.
    rollout_fn: Any = None

    def virtual_time_bound(self) -> float:
        """A generous upper bound on a run's virtual duration, for the no-deadlock property.

        Even with every rollout serialized, every scenario trained in its own step and an
        eval after every step, a run finishes within this.
        """
        n = len(self.plans)
        latencies = sum(p.latency for p in self.plans)
        train = max(self.train_seconds, default=0.0)
        evals = max(self.eval_seconds or (0.0,), default=0.0)
        grace = self.config.shutdown_grace_seconds or 0.0
        stops = (self.stop_at or 0.0) + (self.second_stop_at or 0.0)
        return stops + latencies + (n + 2) * (train + evals) + grace + 100.0


# -- observations ---------------------------------------------------------------------------


@dataclass
class Attempt:
    """One call of the rollout double."""

    scenario_id: int
    started_at: float
    #: "group", "raise", "wrong_type", "nan", "all_failed" or "cancelled" (None: running).
    outcome: str | None = None
    ended_at: float | None = None
    #: A stop had been requested when the rollout returned or raised.
    stopping_at_end: bool = False
    group: art.TrajectoryGroup | None = None
    plan: RolloutPlan | None = None
    #: The group returned has one trajectory or fewer, or all its rewards equal.
    zero_variance: bool = False
    #: Order in which attempts ended, across the run.
    end_seq: int = -1


@dataclass
class TrainCall:
    """One `backend.train` call, as the backend double saw it."""

    run: int
    step: int
    scenario_ids: list[int]
    #: Per group: the oldest `initial_policy_version` of its trajectories.
    initial_versions: list[int | None]
    #: Every trajectory's (initial, final) policy versions.
    version_pairs: list[tuple[int | None, int | None]]
    started_at: float
    ended_at: float
    #: Per group: (policy version, tokens) of every `policy_token_spans` span its
    #: trajectories' choices carry (empty where none do), read here, not by the trainer.
    token_versions: list[list[tuple[int, int]]] = field(default_factory=list)


@dataclass
class Received:
    """A group the training stage took out of the groups channel."""

    scenario_id: int
    version: int | None
    zero_variance: bool
    all_failed: bool
    #: Train calls of this run finished when the group was received.
    steps_done: int
    at: float
    #: (policy version, tokens) of the group's served spans (in-flight updates), else empty.
    tokens: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class EvalRecord:
    step: int
    started_at: float
    ended_at: float | None = None


@dataclass
class RunRecord:
    """Everything observed during one `train()` call."""

    index: int
    start_step: int
    #: Scenario indices the persisted ledger had resolved before this run started.
    resolved_before: frozenset[int] = frozenset()
    #: Set when a forced stop was requested from inside `backend.train`.
    forced_in_train: bool = False
    state_before: PipelineState | None = None
    attempts: list[Attempt] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    publishes: list[int] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    max_concurrent_evals: int = 0
    max_channel_used: int = 0
    channel_max_buffer_size: float | None = None
    counters: Any = None
    collapsed: bool = False
    error: BaseException | None = None
    timed_out: bool = False
    stop_requested: bool = False
    stop_requested_at: float | None = None
    ended_at: float = 0.0
    #: The persisted state after the run, as a new trainer would read it.
    state_after: PipelineState | None = None
    calls: list[TrainCall] = field(default_factory=list)
    #: The sizes in force, the first from before the run, then one per live resize.
    sizes: list[Sizes] = field(default_factory=list)
    #: The stall watchdog's reports (`Stalled` events), with the virtual time of each.
    stalls: list[tuple[float, Any]] = field(default_factory=list)

    def sizes_between(self, start: float, end: float) -> list[Sizes]:
        """Every set of sizes in force at some moment of [start, end]."""
        before = [s for s in self.sizes if s.since <= start][-1:]
        return before + [s for s in self.sizes if start < s.since <= end]

    @property
    def trained_ids(self) -> list[int]:
        return [i for call in self.calls for i in call.scenario_ids]

    def unresolved_after(self, ids: set[int]) -> set[int]:
        return {i for i in ids if not is_resolved(self.state_after, i)}


def is_resolved(state: PipelineState | None, index: int) -> bool:
    """Whether a persisted art_trio state counts scenario `index` as resolved."""
    return state is not None and state.ledger.is_resolved(index)


@dataclass
class Observer:
    """Shared by the doubles of one case; `run` is the record of the `train()` in progress."""

    case: Case
    run: RunRecord
    ended: int = 0
    #: Which scenario a group object came from (by identity), set by the rollout double.
    owners: dict[int, int] = field(default_factory=dict)
    #: Per scenario, what its last group was: (zero variance, all rollouts failed).
    groups: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    #: Per scenario, its last group's served token versions (`served_token_versions`).
    tokens: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: `trainer.request_stop(force=True)` of the run in progress (set by `_run_once`).
    force_stop: Any = None
    #: The backend's newest step now (the weights an in-flight server decodes with).
    backend_step: Any = None


# -- doubles --------------------------------------------------------------------------------


def _trajectory(reward: float) -> art.Trajectory:
    return trajectory(reward, usage=False)


def _planned_group(sid: int, plan: RolloutPlan, attempt: Attempt, policy: int) -> Any:
    """What the plan says the rollout of scenario `sid` returns (or raises); `policy` is the
    trainer's policy version now (a planned future version is counted from it)."""
    if plan.failure == "raise":
        raise PlannedRolloutError(f"planned failure of scenario {sid}")
    if plan.failure == "wrong_type":
        return {"not": "a TrajectoryGroup"}
    items: list[art.Trajectory | BaseException] = [_trajectory(r) for r in plan.rewards]
    if plan.failure == "nan":
        items.append(_trajectory(math.nan))
    if plan.failure == "partial" and plan.rewards:
        items.append(PlannedRolloutError("one rollout of the group failed"))
    if plan.failure == "all_failed":
        attempt.outcome = "all_failed"
        items = [PlannedRolloutError(f"rollout {k} failed") for k in range(2)]
    bad_tokens = BAD_TOKEN_COUNTS.get(plan.failure or "")
    if bad_tokens is not None:
        if not items:
            items.append(_trajectory(0.0))
        first = cast(art.Trajectory, items[0])
        first.metrics["completion_tokens"] = bad_tokens
    if plan.future_by > 0 and items and isinstance(items[0], art.Trajectory):
        items[0].initial_policy_version = policy + plan.future_by
    return art.TrajectoryGroup(items)


def _decoded(trajectory: art.Trajectory, runs: list[tuple[int, int]]) -> None:
    """Give `trajectory` a served choice whose `policy_token_spans` are `runs` of (policy
    version, tokens), and those tokens as its `completion_tokens` (a bad count it was
    planned to carry is kept)."""
    spans, start = [], 0
    for version, tokens in runs:
        spans.append(
            {"start_token": start, "end_token": start + tokens, "generation_id": f"g@{version}",
             "policy_version": version, "lora_slot": "g:active", "update_seq": version}
        )
        start += tokens
    trajectory.messages_and_choices.append(
        Choice.model_validate(
            {"finish_reason": "stop", "index": 0, "policy_token_spans": spans,
             "message": {"role": "assistant", "content": "a"}}
        )
    )
    trajectory.metrics.setdefault("completion_tokens", start)


def served_token_versions(group: art.TrajectoryGroup) -> list[tuple[int, int]]:
    """(policy version, tokens) of every span on the group's served choices."""
    found = []
    for t in group.trajectories:
        for item in t.messages_and_choices:
            extra = getattr(item, "model_extra", None) or {}
            for span in extra.get("policy_token_spans") or ():
                found.append(
                    (span["policy_version"], span["end_token"] - span["start_token"])
                )
    return found


def _outcome(result: Any) -> str:
    """How the trainer will count what a rollout returned (the reference's rules)."""
    if not isinstance(result, art.TrajectoryGroup):
        return "wrong_type"
    if not result.trajectories and result.exceptions:
        return "all_failed"
    if any(math.isnan(t.reward) for t in result.trajectories):
        return "nan"
    return "group"


async def _call_user_rollout(fn: Any, model: Any, scenario: Any, config: Any) -> Any:
    """Call the user's rollout function: trio/anyio-native ones directly, asyncio ones (the
    default, as ART users write them) through the trio-asyncio loop the trainer runs."""
    if is_native(fn):
        return await fn(model, scenario, config)
    return await call_asyncio_from_trio(fn, model, scenario, config)


def make_rollout_fn(observer: Observer) -> Any:
    """A trio-native rollout_fn that follows `observer.case.plans[scenario_id]`: it waits the
    plan's latency (virtual time), then returns the plan's group, or the user's rollout
    function's if the case has one."""
    user_fn = observer.case.rollout_fn
    scenarios = observer.case.scenarios

    @trio_native
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        sid = int(scenario["metadata"]["scenario_id"])
        plan = observer.case.plans[sid]
        run = observer.run
        attempt = Attempt(scenario_id=sid, started_at=trio.current_time(), plan=plan)
        run.attempts.append(attempt)

        def ended(stopping: bool) -> None:
            attempt.ended_at = trio.current_time()
            attempt.end_seq, observer.ended = observer.ended, observer.ended + 1
            attempt.stopping_at_end = stopping

        in_flight = observer.case.config.in_flight_updates and user_fn is None
        runs: list[tuple[int, int]] = []
        try:
            if in_flight:
                for tokens in plan.tokens:
                    runs.append((observer.backend_step(), tokens))
                    await anyio.sleep(plan.latency / len(plan.tokens))
            else:
                await anyio.sleep(plan.latency)
            if user_fn is not None:
                own = scenario if scenarios is None else scenarios[sid]
                result = await _call_user_rollout(user_fn, model, own, config)
        except BaseException as exc:
            cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
            attempt.outcome = "cancelled" if cancelled else "raise"
            ended(False if cancelled else run.stop_requested)
            raise
        # No await from here to the return: the worker reads `stop.stopping` in the same
        # step, so `stopping_at_end` is exactly what the trainer saw.
        ended(run.stop_requested)
        if user_fn is None:
            attempt.outcome = plan.failure if plan.failure in ERROR_KINDS else "group"
            # The trainer's policy now: published versions are recorded the moment they are.
            policy = run.publishes[-1] if run.publishes else run.start_step
            result = _planned_group(sid, plan, attempt, policy)
            if in_flight and isinstance(result, art.TrajectoryGroup):
                for j, t in enumerate(result.trajectories):
                    # The first trajectory's request reached the server late, after the
                    # first chunk: a group's first token is then not its oldest.
                    _decoded(t, runs[1:] if j == 0 and len(runs) > 1 else runs)
        else:
            attempt.outcome = _outcome(result)
        if not isinstance(result, art.TrajectoryGroup):
            return result
        group = result
        attempt.group = group
        observer.owners[id(group)] = sid
        rewards = [t.reward for t in group.trajectories]
        attempt.zero_variance = len(rewards) <= 1 or len(set(rewards)) == 1
        observer.groups[sid] = (
            attempt.zero_variance,
            not group.trajectories and bool(group.exceptions),
        )
        observer.tokens[sid] = served_token_versions(group)
        return group

    return rollout


def make_eval_fn(observer: Observer) -> Any:
    """A trio-native eval double that works the planned durations and records start and end."""
    run = observer.run

    def started(call: EvalCall) -> EvalRecord:
        record = EvalRecord(step=call.step, started_at=call.started_at)
        run.evals.append(record)
        run.max_concurrent_evals = max(run.max_concurrent_evals, evaluate.active + 1)
        return record

    def ended(call: EvalCall) -> None:
        call.token.ended_at = call.ended_at

    evaluate = EvalDouble(
        observer.case.eval_seconds or (0.0,), usage=False, on_start=started, on_end=ended
    )
    return trio_native(evaluate)


class BackendDouble(SharedBackendDouble):
    """The shared ART Backend double, asyncio flavor (reached through trio-asyncio like a real
    ART backend): its step persists across trainers, like a server's.

    `train` sleeps the planned training time (virtual under trio-asyncio + MockClock) and
    records the batch by scenario identity, not by what the trainer wrote on the groups.
    """

    def __init__(self, observer: Observer) -> None:
        super().__init__(train_time=observer.case.train_seconds or (0.0,), flavor="asyncio")
        self.observer = observer
        self.calls: list[TrainCall] = []
        self.in_flight_updates = observer.case.config.in_flight_updates
        observer.backend_step = lambda: self.step

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        observer, run = self.observer, self.observer.run
        if (
            observer.case.force_stop_in_train == self.step + 1
            and run.index == 0
            and not run.forced_in_train
            and observer.force_stop is not None
        ):
            # From inside the call, as a second SIGINT arriving now would: the train call
            # is cancelled at its next checkpoint, before it produces the step.
            run.forced_in_train = True
            run.stop_requested = True
            run.stop_requested_at = trio.current_time()
            observer.force_stop()

    def record(self, batch: TrainBatch) -> None:
        owners = self.observer.owners
        groups = batch.groups
        call = TrainCall(
            run=self.observer.run.index,
            step=batch.step,
            scenario_ids=[owners.get(id(g), -1) for g in groups],
            initial_versions=[group_initial_version(g) for g in groups],
            version_pairs=[
                (t.initial_policy_version, t.final_policy_version)
                for g in groups
                for t in g.trajectories
            ],
            started_at=batch.start,
            ended_at=batch.end,
            token_versions=[served_token_versions(g) for g in groups],
        )
        self.calls.append(call)
        self.observer.run.calls.append(call)


# -- observation: the trainer's public events ---------------------------------------------


def observe(observer: Observer, trainer: PipelineTrainer[Any, Any]) -> None:
    """Record what the trainer reports through `add_observer`: the groups it took out of the
    channel (with the channel's occupancy just before, and what was left at close: together
    the channel's exact maximum, since only sends grow it) and each published version."""

    def on_event(event: RunEvent) -> None:
        run = observer.run
        if isinstance(event, GroupReceived):
            run.max_channel_used = max(run.max_channel_used, event.groups_in_channel)
            received = observer.groups.get(event.scenario_index)
            run.received.append(
                Received(
                    scenario_id=event.scenario_index,
                    version=event.policy_version,
                    zero_variance=received is not None and received[0],
                    all_failed=received is not None and received[1],
                    steps_done=len(run.calls),
                    at=trio.current_time(),
                    tokens=observer.tokens.get(event.scenario_index, []),
                )
            )
        elif isinstance(event, ChannelClosed):
            run.max_channel_used = max(run.max_channel_used, event.groups_left)
        elif isinstance(event, PolicyPublished):
            run.publishes.append(event.version)
        elif isinstance(event, Stalled):
            run.stalls.append((trio.current_time(), event.report))

    trainer.add_observer(on_event)


# -- running ----------------------------------------------------------------------------------


def read_state(model: art.TrainableModel) -> PipelineState | None:
    """The persisted pipeline state, read the way a resuming trainer reads it."""
    return StateStore(model._get_output_dir()).read()


def _new_model(base_path: Path) -> art.TrainableModel:
    return trainable_model(
        name="m", project="p", base_model="test-base", base_path=str(base_path)
    )


def scenarios_for(case: Case) -> list[dict[str, Any]]:
    """The trainer's source: each scenario tagged with its index (the user's inside)."""
    if case.scenarios is None:
        return [{"metadata": {"scenario_id": i}} for i in range(len(case.plans))]
    return [
        {"metadata": {"scenario_id": i}, "scenario": s} for i, s in enumerate(case.scenarios)
    ]


@dataclass
class CaseResult:
    case: Case
    runs: list[RunRecord]
    backend: BackendDouble


async def _drive(
    trainer: PipelineTrainer[Any, Any],
    record: RunRecord,
    stop_at: float | None,
    bound: float,
    resizes: tuple[Resize, ...] = (),
) -> None:
    s = trainer.settings
    record.sizes.append(
        Sizes(-math.inf, s.sizes.min_batch_size, s.sizes.max_batch_size, s.groups_capacity)
    )
    async with trio.open_nursery() as nursery:
        if resizes:

            async def resizer() -> None:
                for r in sorted(resizes, key=lambda r: r.at):
                    await trio.sleep_until(r.at)
                    min_batch, max_batch = r.batch_sizes or (None, None)
                    stats = trainer.resize(
                        num_rollout_workers=r.num_rollout_workers, min_batch_size=min_batch,
                        max_batch_size=max_batch, queue_maxsize=r.queue_maxsize,
                        reason="property test",
                    )
                    record.sizes.append(Sizes(trio.current_time(), stats.min_batch_size,
                                              stats.max_batch_size, stats.queue_capacity))

            nursery.start_soon(resizer)
        if stop_at is not None:

            async def stopper() -> None:
                await trio.sleep(stop_at)
                record.stop_requested = True
                record.stop_requested_at = trio.current_time()
                trainer.request_stop()

            nursery.start_soon(stopper)
        with trio.move_on_after(bound) as scope:
            try:
                await trainer.train(handle_signals=False)
            except Exception as exc:  # the all-failed property inspects it
                record.error = exc
        record.timed_out = scope.cancelled_caught
        record.ended_at = trio.current_time()
        nursery.cancel_scope.cancel()


def _run_once(
    case: Case,
    observer: Observer,
    backend: BackendDouble,
    base_path: Path,
    index: int,
    stop_at: float | None,
) -> RunRecord:
    model = _new_model(base_path)
    state_before = read_state(model)
    resolved_before = frozenset(
        i for i in range(len(case.plans)) if is_resolved(state_before, i)
    )
    record = RunRecord(
        index=index,
        start_step=backend.step,
        resolved_before=resolved_before,
        state_before=state_before,
    )
    observer.run = record
    # ART's register() is asyncio code; the backend double is too.
    asyncio.run(model.register(cast(Any, backend)))
    trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
        model,
        backend,
        make_rollout_fn(observer),
        scenarios_for(case),
        None,
        make_eval_fn(observer) if case.eval_seconds is not None else None,
        log_interval_seconds=1e9,
        fsync_state=False,
        **case.config.kwargs(),
    )
    observe(observer, trainer)
    observer.force_stop = functools.partial(trainer.request_stop, force=True)
    trio.run(
        _drive,
        trainer,
        record,
        stop_at,
        case.virtual_time_bound(),
        case.resizes,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    record.counters = trainer.last_counters
    stats = trainer.statistics()
    record.collapsed = stats.collapsed
    record.channel_max_buffer_size = stats.queue_capacity
    record.state_after = read_state(model)
    return record


def run_case(case: Case) -> CaseResult:
    """Run `case` once on a fresh model directory (one `train()`)."""
    with tempfile.TemporaryDirectory(prefix="art_trio_prop_") as tmp:
        observer = Observer(case=case, run=RunRecord(index=0, start_step=0))
        backend = BackendDouble(observer)
        record = _run_once(case, observer, backend, Path(tmp), 0, case.stop_at)
        return CaseResult(case=case, runs=[record], backend=backend)


def run_resume_case(case: Case) -> CaseResult:
    """Run `case` stopped at `stop_at`, then resume it with a new trainer and model object
    on the same model directory and the same backend (whose step persists)."""
    with tempfile.TemporaryDirectory(prefix="art_trio_prop_") as tmp:
        observer = Observer(case=case, run=RunRecord(index=0, start_step=0))
        backend = BackendDouble(observer)
        first = _run_once(case, observer, backend, Path(tmp), 0, case.stop_at)
        second = _run_once(case, observer, backend, Path(tmp), 1, case.second_stop_at)
        return CaseResult(case=case, runs=[first, second], backend=backend)


__all__ = [
    "Attempt",
    "BackendDouble",
    "Case",
    "CaseResult",
    "Config",
    "BAD_TOKEN_COUNTS",
    "ERROR_KINDS",
    "EvalRecord",
    "FAILURE_KINDS",
    "Observer",
    "Received",
    "RolloutPlan",
    "RunRecord",
    "TrainCall",
    "is_resolved",
    "run_case",
    "run_resume_case",
]
