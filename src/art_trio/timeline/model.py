"""A run as the picture and the trace show it, folded from a log's events.

Plain frozen values; nothing refers back to a trainer. A rollout's lane is its worker slot
(`lanes.Lanes`); its start version is the policy last published before it started (the events
do not carry it; the group's own version, where it reached the trainer, is `group_version`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from .lanes import Lanes
from .read import TimelineError, is_number, read_log, shown

_T = TypeVar("_T")

#: The fates a rollout bar can have: the run's `Fate` values, plus `given_back` (lost with its
#: executor worker, its scenario taken again) and `unsettled` (no fate heard before the end).
FATES = (
    "trained",
    "stale",
    "cancelled_stale",
    "zero_variance",
    "errored",
    "dropped_at_stop",
    "given_back",
    "unsettled",
)


@dataclass(frozen=True, slots=True)
class Rollout:
    scenario_index: int
    lane: int
    start: float
    end: float
    fate: str
    #: The policy last published when it started.
    start_version: int | None
    #: The group's `initial_policy_version` as the trainer received it (None: never received).
    group_version: int | None = None
    #: For a trained group: the step, its age in steps (policy trained from minus its
    #: version), and its seconds queued (handed over until its batch was taken).
    step: int | None = None
    age_steps: int | None = None
    queued_s: float | None = None
    #: Its tokens' mean policy age in steps, each token aged by the policy that produced it.
    age_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class Band:
    """A training call (`step` it produces) or an eval (`step` it evaluates), or a stall."""

    step: int | None
    start: float
    end: float
    #: The call ended with a result / the eval completed.
    completed: bool = True


@dataclass(frozen=True, slots=True)
class StepAges:
    """A trained step's staleness: per group in steps, the tokens' weighted mean, queue waits."""

    step: int
    t: float
    ages: tuple[int, ...]
    #: Token-weighted mean policy age of the batch (None: its groups carried no tokens).
    token_age: float | None
    queued_s: tuple[float, ...]


@dataclass(frozen=True)
class RunTimeline:
    path: Path
    trainer: str
    start: float
    end: float
    outcome: str
    rollouts: tuple[Rollout, ...]
    train_calls: tuple[Band, ...]
    evals: tuple[Band, ...]
    stalls: tuple[Band, ...]
    #: (time, version) of every policy published.
    publishes: tuple[tuple[float, int], ...]
    steps: tuple[StepAges, ...]
    lanes: int
    settings: dict[str, Any] = field(default_factory=dict)

    def fate_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(FATES, 0)
        for r in self.rollouts:
            counts[r.fate] = counts.get(r.fate, 0) + 1
        return counts


@dataclass
class _Open:
    index: int
    lane: int
    start: float
    start_version: int | None
    end: float | None = None
    fate: str | None = None
    group_version: int | None = None
    queued_at: float | None = None


class _Fold:
    def __init__(self, version: int | None) -> None:
        self.lanes = Lanes()
        self.version = version
        #: Rollouts running, or ended and waiting for their fate (a trained group's: its step).
        self.open: dict[int, _Open] = {}
        self.done: list[Rollout] = []
        self.calls: dict[int, list[float | None]] = {}
        self.call_ok: dict[int, bool] = {}
        self.evals: dict[int, float] = {}
        self.eval_bands: list[Band] = []
        self.stalls: list[Band] = []
        self.publishes: list[tuple[float, int]] = []
        self.taken_at: dict[int, float] = {}
        self.steps: list[StepAges] = []

    def ended(self, r: _Open, t: float) -> None:
        if r.end is None:
            r.end = t
            self.lanes.give_back(r.lane)

    def finish(self, r: _Open, end: float, **trained: Any) -> None:
        del self.open[r.index]
        self.ended(r, end)
        assert r.end is not None
        fate = r.fate or "unsettled"
        rollout = Rollout(r.index, r.lane, r.start, r.end, fate, r.start_version, r.group_version)
        self.done.append(replace(rollout, **trained))

    def event(self, e: dict[str, Any]) -> None:
        t, name = float(e["t"]), e["event"]
        if name == "RolloutStarted":
            self.rollout_started(t, _int(e, "scenario_index"))
        elif name in _ROLLOUT_EVENTS:
            # None: a rollout already finished (or never seen starting); nothing to update.
            if (r := self.open.get(_int(e, "scenario_index"))) is not None:
                _ROLLOUT_EVENTS[name](self, r, t, e)
        elif name in _RUN_EVENTS:
            _RUN_EVENTS[name](self, t, e)

    def rollout_started(self, t: float, index: int) -> None:
        if (r := self.open.get(index)) is not None:  # given back and taken again: it ended
            r.fate = r.fate or "given_back"
            self.finish(r, t)
        self.open[index] = _Open(index, self.lanes.take(), t, self.version)

    def rollout_ended(self, r: _Open, t: float, e: dict[str, Any]) -> None:
        self.ended(r, t)
        self.finish_if_settled(r, t)

    def rollout_settled(self, r: _Open, t: float, e: dict[str, Any]) -> None:
        """`ScenarioSettled` (its fate) or `RolloutGivenBack` (no fate: given back)."""
        r.fate = _text(e, "fate", "given_back")
        self.finish_if_settled(r, t)

    def finish_if_settled(self, r: _Open, t: float) -> None:
        # A trained rollout stays open until its step, which says its age and queue wait.
        if r.end is not None and r.fate not in (None, "trained"):
            self.finish(r, t)

    def group_queued(self, r: _Open, t: float, e: dict[str, Any]) -> None:
        r.queued_at = t

    def group_received(self, r: _Open, t: float, e: dict[str, Any]) -> None:
        r.group_version = _version(e, "policy_version")

    def batch_taken(self, t: float, e: dict[str, Any]) -> None:
        self.taken_at[_int(e, "step")] = t

    def train_call_started(self, t: float, e: dict[str, Any]) -> None:
        self.calls[_int(e, "step")] = [t, None]

    def train_call_ended(self, t: float, e: dict[str, Any]) -> None:
        self.calls.setdefault(_int(e, "step"), [t, None])[1] = t

    def policy_published(self, t: float, e: dict[str, Any]) -> None:
        self.version = _int(e, "version")
        self.publishes.append((t, self.version))

    def eval_started(self, t: float, e: dict[str, Any]) -> None:
        self.evals[_int(e, "step")] = t

    def eval_ended(self, t: float, e: dict[str, Any]) -> None:
        step = _int(e, "step")
        completed = _get(e, "completed", lambda v: type(v) is bool, "true or false", True)
        self.eval_bands.append(Band(step, self.evals.pop(step, t), t, completed))

    def stalled(self, t: float, e: dict[str, Any]) -> None:
        self.stalls.append(Band(None, t - _number(e, "seconds", 0.0), t))

    def step_trained(self, t: float, e: dict[str, Any]) -> None:
        step = _int(e, "step")
        self.call_ok[step] = True
        taken = self.taken_at.get(step, t)
        ages = _list(e, "staleness", _is_int, "integers")
        token_ages = _list(e, "token_staleness", lambda v: v is None or is_number(v), "ages")
        waits = []
        for i, index in enumerate(_list(e, "scenario_indices", _is_int, "integers")):
            r = self.open.get(index)
            if r is None:
                continue
            queued = None if r.queued_at is None else max(0.0, taken - r.queued_at)
            waits.append(queued if queued is not None else 0.0)
            r.fate = "trained"
            age = ages[i] if i < len(ages) else None
            by_tokens = token_ages[i] if i < len(token_ages) else None
            self.finish(r, t, step=step, age_steps=age, queued_s=queued, age_tokens=by_tokens)
        weighted, tokens = (list(_list(e, "token_ages", is_number, "numbers")) + [0.0, 0.0])[:2]
        token_age = weighted / tokens if tokens else None
        self.steps.append(StepAges(step, t, ages, token_age, tuple(waits)))

    def finish_open(self, end: float) -> None:
        """Finish the rollouts still open at `end`: running, or waiting for their fate or step."""
        for r in list(self.open.values()):
            self.finish(r, end)

    def call_bands(self, end: float) -> tuple[Band, ...]:
        """The training calls by step; one still running at `end` is cut there. A call completed
        when its step was trained."""
        return tuple(
            Band(step, begun, end if finished is None else finished, self.call_ok.get(step, False))
            for step, (begun, finished) in sorted(self.calls.items())
            if begun is not None
        )

    def all_evals(self, end: float) -> tuple[Band, ...]:
        """The evals that ended, then those still running at `end` (cut there, not completed)."""
        running = tuple(Band(step, begun, end, False) for step, begun in self.evals.items())
        return tuple(self.eval_bands) + running


#: What an event about one open rollout does to it (keyed by the event's name).
_ROLLOUT_EVENTS: dict[str, Callable[[_Fold, _Open, float, dict[str, Any]], None]] = {
    "RolloutEnded": _Fold.rollout_ended,
    "ScenarioSettled": _Fold.rollout_settled,
    "RolloutGivenBack": _Fold.rollout_settled,
    "GroupQueued": _Fold.group_queued,
    "GroupReceived": _Fold.group_received,
}

#: What the trainer's events do to the run (keyed by the event's name; others are ignored).
_RUN_EVENTS: dict[str, Callable[[_Fold, float, dict[str, Any]], None]] = {
    "BatchTaken": _Fold.batch_taken,
    "TrainCallStarted": _Fold.train_call_started,
    "TrainCallEnded": _Fold.train_call_ended,
    "StepTrained": _Fold.step_trained,
    "PolicyPublished": _Fold.policy_published,
    "EvalStarted": _Fold.eval_started,
    "EvalEnded": _Fold.eval_ended,
    "Stalled": _Fold.stalled,
}


def fold(path: Path, header: dict[str, Any], events: list[dict[str, Any]]) -> RunTimeline:
    """The run a log's events describe (the first `RunStarted` to its `RunEnded`)."""
    started = _run_started(path, events)
    base = _checked(path, started, lambda e: _version(e, "policy_version"))
    f = _Fold(base)
    ended = next((e for e in events if e["event"] == "RunEnded"), None)
    for e in events:
        _checked(path, e, f.event)
    end = float(ended["t"]) if ended else max((float(e["t"]) for e in events), default=0.0)
    f.finish_open(end)
    rollouts = _resumed_start_versions(f.done, f.publishes, base)
    outcome = _checked(path, ended, lambda e: _text(e, "outcome", "?")) if ended else "unfinished"
    return RunTimeline(
        path=path,
        trainer=str(header.get("trainer", "?")),
        start=float(started["t"]),
        end=end,
        outcome=outcome,
        rollouts=tuple(sorted(rollouts, key=lambda r: r.start)),
        train_calls=f.call_bands(end),
        evals=f.all_evals(end),
        stalls=tuple(f.stalls),
        publishes=tuple(f.publishes),
        steps=tuple(f.steps),
        lanes=f.lanes.count,
        settings={k: v for k, v in started.items() if k not in {"t", "event", "_line"}},
    )


def _run_started(path: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    started = next((e for e in events if e["event"] == "RunStarted"), None)
    if started is None:
        raise TimelineError(
            f"{path}: no RunStarted line; the log was not written by a recorder around "
            "train() (art_trio.timeline.record_timeline)"
        )
    return started


class _Garbled(TimelineError):
    """A field an event needs is missing or not what it must be (the message says which);
    `_checked` adds the file and the line."""


def _checked(path: Path, e: dict[str, Any], read: Callable[[dict[str, Any]], _T]) -> _T:
    """`read(e)`; a field it finds garbled is an error naming the file and `e`'s line."""
    try:
        return read(e)
    except _Garbled as exc:
        raise TimelineError(f"{path}: line {e['_line']} ({e['event']}) is garbled: {exc}") from None


_MISSING: Any = object()


def _get(
    e: dict[str, Any], key: str, ok: Callable[[Any], bool], what: str, default: Any = _MISSING
) -> Any:
    """`e[key]` if `ok` says it is `what`; `default` if there is none (without one: garbled)."""
    if key not in e:
        if default is _MISSING:
            raise _Garbled(f'no "{key}"')
        return default
    if not ok(e[key]):
        raise _Garbled(f'"{key}" is {shown(e[key])}, not {what}')
    return e[key]


def _is_int(value: Any) -> bool:
    return type(value) is int  # not true or false, nor 1.0


def _int(e: dict[str, Any], key: str) -> int:
    return int(_get(e, key, _is_int, "an integer"))


def _version(e: dict[str, Any], key: str) -> int | None:
    return _get(e, key, lambda v: v is None or _is_int(v), "a version (an integer or null)", None)


def _number(e: dict[str, Any], key: str, default: float) -> float:
    return float(_get(e, key, is_number, "a finite number", default))


def _text(e: dict[str, Any], key: str, default: str) -> str:
    return str(_get(e, key, lambda v: isinstance(v, str), "a string", default))


def _list(e: dict[str, Any], key: str, ok: Callable[[Any], bool], what: str) -> tuple[Any, ...]:
    """`e[key]`, a list of `what` (each as `ok` says), or none."""
    return tuple(
        _get(e, key, lambda v: isinstance(v, list) and all(map(ok, v)), f"a list of {what}", [])
    )


def _resumed_start_versions(
    rollouts: list[Rollout], publishes: list[tuple[float, int]], base: int | None
) -> list[Rollout]:
    # The version a run starts from is read before train() (statistics say 0 until the run
    # starts); a resumed run's first publish shows it was later: its start versions follow.
    first = publishes[0] if publishes else None
    if first is not None and (base is None or first[1] - 1 > base):
        return [
            replace(r, start_version=first[1] - 1) if r.start < first[0] else r for r in rollouts
        ]
    return rollouts


def load_timeline(path: str | Path, *, require_steps: bool = True) -> RunTimeline:
    """The run recorded at `path`. With `require_steps` (the default), a run that trained no
    step is an error: there is nothing to compare a plan or another run against."""
    path = Path(path)
    header, events = read_log(path)
    run = fold(path, header, events)
    if require_steps and not run.steps:
        raise no_steps_error(run, "pass require_steps=False to draw it anyway")
    return run


def no_steps_error(run: RunTimeline, override: str) -> TimelineError:
    """The error for a run that trained no step; `override` says how to draw it anyway."""
    return TimelineError(
        f"{run.path}: the run trained no step ({len(run.rollouts)} rollouts, outcome "
        f"{run.outcome}); nothing to draw. Record a run that trains at least one step "
        f"(max_steps >= 1, and past start-up), or {override}"
    )
