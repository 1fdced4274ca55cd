"""`RunTracer`: an observer that turns a run's events into OpenTelemetry spans.

It hears each event in the trainer's task (`trainer.add_observer`) and only notes times and
facts; it never calls into the run. Timestamps are wall-clock nanoseconds read when an event is
heard (what tracing backends expect). A rollout's or a training call's span is made whole once
its last fact is known, with the start and end times noted on the way: a rollout's ends at its
`RolloutEnded`, but its fate may come later (a trained group's fate, step and age arrive with
`StepTrained`); a training call's ends at its `TrainCallEnded`, but its batch's ages and the
version it published come after. Making each span in one call (attributes, events, start and
end together) is also what keeps the observer cheap on the hot path: a rollout costs one span
creation. The run's span is open for the whole run (its children name it as their parent);
`finish()` makes whatever is still pending and ends it, so nothing outlives the run.

Events are dispatched by class name: several (`RolloutStarted`, `TrainCallStarted`, ...) are
public as events but not exported by `art_trio`, and a tool uses the public names only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

from art_trio.timeline.lanes import Lanes

from . import names as n

if TYPE_CHECKING:
    from art_trio import RunEvent, RunStatistics


@dataclass
class _Pending:
    """A span in the making: its start, its attributes and events so far, its end once known."""

    start_ns: int
    attributes: dict[str, Any]
    lane: int = -1
    end_ns: int | None = None
    fate: str | None = None
    queued_ns: int | None = None
    events: list[tuple[str, dict[str, Any], int]] = field(default_factory=list)


class RunTracer:
    """Spans for one run: `start(attributes)`, then the events, then `finish(...)`.

    `tracer_provider`: any OpenTelemetry `TracerProvider` (default: the global one, as set by
    `opentelemetry.trace.set_tracer_provider` or an auto-instrumentation agent).
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        from art_trio import __version__

        self._tracer = trace.get_tracer("art_trio", __version__, tracer_provider=tracer_provider)
        self._now = clock_ns
        self._run: Span | None = None
        self._context: Any = None
        self._lanes = Lanes()
        self._version: int | None = None
        self._read_version: Callable[[], int] | None = None
        self._published = False
        self._rollouts: dict[int, _Pending] = {}
        self._calls: dict[int, _Pending] = {}
        self._taken_ns: dict[int, int] = {}
        self._evals: dict[int, _Pending] = {}
        self._handlers: dict[type, Callable[[Any, int], None]] = {}

    @property
    def run_span(self) -> Span | None:
        return self._run

    def start(
        self,
        attributes: dict[str, Any],
        *,
        policy_version: int | None = None,
        read_policy_version: Callable[[], int] | None = None,
    ) -> None:
        """Open the run's span; rollouts started from now on are its children.

        `read_policy_version`, where given, is read at the first event and replaces
        `policy_version`: the version a run starts from (the backend's step) is known once
        the run runs, not before `train()` is called."""
        self._run = self._tracer.start_span(n.RUN, attributes=attributes, start_time=self._now())
        self._context = trace.set_span_in_context(self._run)
        self._version = policy_version
        self._read_version = read_policy_version

    def __call__(self, event: RunEvent) -> None:
        if self._read_version is not None:
            read, self._read_version = self._read_version, None
            self._version = read()
            if self._run is not None:
                self._run.set_attribute(n.RUN_POLICY_VERSION, self._version)
        kind = type(event)
        handler = self._handlers.get(kind)
        if handler is None:
            handler = self._handlers[kind] = getattr(self, f"_on_{kind.__name__}", _ignore)
        handler(event, self._now())

    # ----- rollouts ---------------------------------------------------------------------

    def _on_RolloutStarted(self, e: Any, now: int) -> None:
        previous = self._rollouts.get(e.scenario_index)
        if previous is not None:  # given back and taken again: the earlier one ended
            previous.fate = previous.fate or "given_back"
            self._close_rollout(e.scenario_index, now)
        lane = self._lanes.take()
        attributes = {n.SCENARIO: e.scenario_index, n.LANE: lane}
        if self._version is not None:
            attributes[n.START_VERSION] = self._version
        self._rollouts[e.scenario_index] = _Pending(now, attributes, lane)

    def _on_RolloutEnded(self, e: Any, now: int) -> None:
        r = self._rollouts.get(e.scenario_index)
        if r is None or r.end_ns is not None:
            return
        r.end_ns = now
        self._lanes.give_back(r.lane)
        r.attributes[n.SPENT_S] = e.spent_s
        if r.fate is not None and r.fate != "trained":
            self._close_rollout(e.scenario_index, now)

    def _on_ScenarioSettled(self, e: Any, now: int) -> None:
        r = self._rollouts.get(e.scenario_index)
        if r is None:
            return
        r.fate = e.fate.value
        if r.fate == "cancelled_stale":
            r.events.append((n.EV_CANCELLED, {"reason": "stale"}, now))
        if r.fate != "trained" and r.end_ns is not None:
            self._close_rollout(e.scenario_index, now)

    def _on_RolloutGivenBack(self, e: Any, now: int) -> None:
        r = self._rollouts.get(e.scenario_index)
        if r is not None:
            r.fate = "given_back"
            r.events.append((n.EV_GIVEN_BACK, {}, now))

    def _on_GroupQueued(self, e: Any, now: int) -> None:
        if (r := self._rollouts.get(e.scenario_index)) is not None:
            r.queued_ns = now

    def _on_GroupReceived(self, e: Any, now: int) -> None:
        if (r := self._rollouts.get(e.scenario_index)) is not None and e.policy_version is not None:
            r.attributes[n.GROUP_VERSION] = e.policy_version

    def _close_rollout(self, index: int, now: int) -> None:
        r = self._rollouts.pop(index)
        if r.end_ns is None:
            self._lanes.give_back(r.lane)
        r.attributes[n.FATE] = r.fate or "unsettled"
        self._emit(n.ROLLOUT, r, now)

    def _emit(self, name: str, pending: _Pending, now: int) -> None:
        span = self._tracer.start_span(
            name, context=self._context, attributes=pending.attributes, start_time=pending.start_ns
        )
        for event, attributes, at in pending.events:
            span.add_event(event, attributes, timestamp=at)
        span.end(end_time=pending.end_ns if pending.end_ns is not None else now)

    # ----- training, publishing, evals, stalls -------------------------------------------

    def _on_BatchTaken(self, e: Any, now: int) -> None:
        self._taken_ns[e.step] = now

    def _on_TrainCallStarted(self, e: Any, now: int) -> None:
        self._calls[e.step] = _Pending(now, {n.STEP: e.step})

    def _on_TrainCallEnded(self, e: Any, now: int) -> None:
        if (call := self._calls.get(e.step)) is not None:
            call.end_ns = now
            call.attributes[n.TRAIN_S] = e.train_s

    def _on_StepTrained(self, e: Any, now: int) -> None:
        taken = self._taken_ns.pop(e.step, now)
        weighted, tokens = e.token_ages
        if (call := self._calls.get(e.step)) is not None:
            call.attributes.update(
                {
                    n.GROUPS: e.batch_size,
                    n.SCENARIOS: list(e.scenario_indices),
                    n.AGES: list(e.staleness),
                    n.TOKENS: tokens,
                    n.COMPLETED: True,
                }
            )
            if tokens:
                call.attributes[n.TOKEN_AGE] = weighted / tokens
            if e.reward_mean is not None:
                call.attributes[n.REWARD] = e.reward_mean
        for i, index in enumerate(e.scenario_indices):
            r = self._rollouts.get(index)
            if r is None:
                continue
            r.fate = "trained"
            r.attributes[n.STEP] = e.step
            if i < len(e.staleness):
                r.attributes[n.AGE_STEPS] = e.staleness[i]
            if i < len(e.token_staleness) and e.token_staleness[i] is not None:
                r.attributes[n.AGE_TOKENS] = e.token_staleness[i]
            if r.queued_ns is not None:
                r.attributes[n.QUEUED_S] = max(0, taken - r.queued_ns) / 1e9
            self._close_rollout(index, now)

    def _on_PolicyPublished(self, e: Any, now: int) -> None:
        if not self._published and (self._version is None or e.version - 1 > self._version):
            # The start version was read before train() (0 until the run starts); a resumed
            # run's first publish shows a later one: the rollouts still pending follow it.
            for r in self._rollouts.values():
                r.attributes[n.START_VERSION] = e.version - 1
        self._published = True
        self._version = e.version
        if self._run is not None:
            self._run.add_event(n.EV_PUBLISHED, {"version": e.version}, timestamp=now)
        call = self._calls.pop(e.version, None)
        if call is not None:
            call.attributes[n.PUBLISHED] = e.version
            call.events.append((n.EV_PUBLISHED, {"version": e.version}, now))
            self._emit(n.TRAIN, call, now)

    def _on_EvalStarted(self, e: Any, now: int) -> None:
        self._evals[e.step] = _Pending(now, {n.STEP: e.step})

    def _on_EvalEnded(self, e: Any, now: int) -> None:
        pending = self._evals.pop(e.step, None)
        if pending is not None:
            pending.attributes[n.COMPLETED] = e.completed
            if e.reward is not None:
                pending.attributes[n.REWARD] = e.reward
            pending.end_ns = now
            self._emit(n.EVAL, pending, now)

    def _on_Stalled(self, e: Any, now: int) -> None:
        report = e.report
        attributes = {
            n.STALL_S: e.seconds,
            n.STALL_REPEAT: int(report.repeat),
            n.BLOCKED_LOOP: bool(report.blocked_loop),
        }
        self._emit(n.STALL, _Pending(now - int(e.seconds * 1e9), attributes, end_ns=now), now)

    def _on_Resized(self, e: Any, now: int) -> None:
        if self._run is not None:
            self._run.add_event(
                n.EV_RESIZED,
                {
                    "num_rollout_workers": e.num_rollout_workers,
                    "min_batch_size": e.min_batch_size,
                    "max_batch_size": e.max_batch_size,
                    "reason": e.reason,
                },
                timestamp=now,
            )

    def _on_Collapsed(self, e: Any, now: int) -> None:
        if self._run is not None:
            self._run.add_event(n.EV_COLLAPSED, {"held": e.held}, timestamp=now)

    # ----- the end ----------------------------------------------------------------------

    def finish(
        self,
        outcome: str,
        error: BaseException | None = None,
        statistics: RunStatistics | None = None,
    ) -> None:
        """Make every span still pending (rollouts without a fate as `unsettled`, calls and
        evals as not completed), then end the run's, with `outcome` and the run's counters."""
        now = self._now()
        for index in list(self._rollouts):
            self._close_rollout(index, now)
        for name, pending in [(n.TRAIN, c) for c in self._calls.values()] + [
            (n.EVAL, e) for e in self._evals.values()
        ]:
            pending.attributes.setdefault(n.COMPLETED, False)
            self._emit(name, pending, now)
        self._calls.clear()
        self._evals.clear()
        run = self._run
        if run is None:
            return
        self._run = None
        run.set_attribute(n.OUTCOME, outcome)
        if statistics is not None:
            run.set_attributes(_counters(statistics))
        if outcome == "cancelled":
            run.add_event(n.EV_RUN_CANCELLED, timestamp=now)
        elif error is not None:
            run.record_exception(error, timestamp=now)
            run.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        run.end(end_time=now)


def _counters(stats: RunStatistics) -> dict[str, Any]:
    names = (
        "steps",
        "taken",
        "trained",
        "stale",
        "stale_cancelled",
        "zero_variance",
        "errored",
        "dropped_at_stop",
        "rollouts_started",
        "rollouts_lost",
        "stalls",
    )
    attributes: dict[str, Any] = {f"art_trio.run.{name}": getattr(stats, name) for name in names}
    if stats.token_policy_age is not None:
        attributes["art_trio.run.token_policy_age"] = stats.token_policy_age
    if stats.trainer_utilization is not None:
        attributes["art_trio.run.trainer_utilization"] = stats.trainer_utilization
    return attributes


def _ignore(event: Any, now: int) -> None:
    pass
