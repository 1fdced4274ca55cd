"""The stall watchdog: when the run stops moving, say where it waits.

The run moves when a rollout ends, a step trains or an eval ends (the counters folded from
the events: `rollouts_ended`, `steps`, `evals_ended`). Whatever is in flight ends within its
own duration, so a run whose rollouts, steps and evals each take less than `stall_seconds`
always moves within `stall_seconds`: the watchdog never reports a slow run that progresses.
Starting something is not moving: a run can start rollouts forever that never end (an
inference server that stopped answering), and a step that waits for a hung `backend.train`
(ART issue 656) starts nothing at all.

Two watchers:
- this stage, a task of the run's task group, wakes every quarter of `stall_seconds` on the
  run's own clock (virtual under trio's MockClock) and compares the counters. Nothing runs
  per rollout: the stages already count what it reads. When nothing moved for
  `stall_seconds` it reports once, then again at 2x, 4x, ... while the stall persists;
- a daemon thread pings the event loop (`run_sync_soon` / `call_soon_threadsafe`) on the wall
  clock: a loop that does not answer within `stall_seconds` is blocked by synchronous code
  (`time.sleep` in a rollout, a tokenizer in the loop), and the thread reports it with the
  loop thread's stack (`sys._current_frames()`). The thread logs at once; the event, the
  counter and the action follow when the loop runs again.

A report is a log record (warning), a line beside the status line, the `Stalled` event (and
`RunStatistics.stalls`), then `stall_action`: "raise" ends the run with `PipelineStalled`
(state saved), "stop" stops it as `request_stop()` does.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import anyio
import sniffio

from ..config.settings import STALL_FLOOR_SECONDS, STALL_MULTIPLE
from ..messages.events import RunEvent, Stalled
from ..messages.values import RolloutInFlight
from ..observation.fates import RunCounters
from ..observation.status import StatusReporter
from ..plumbing.bridge.calls import Bridge
from ..plumbing.group_queue import GroupQueueStatistics
from ..plumbing.stop import StopControl
from ..policy.admission import reference_gate_allows
from ..policy.gate import PolicyGate
from ..policy.gate_snapshot import GateSnapshot
from ..run import CallsInFlight
from .report import PipelineStalled, StageWait, StallReport
from .tasktree import task_tree, thread_stack

logger = logging.getLogger("art_trio")

#: The blocked-loop thread pings the loop at most this often (wall seconds).
PING_INTERVAL_S = 1.0


@dataclass(kw_only=True, eq=False)
class WatchdogStage:
    """Reports a run that stopped moving, and a loop that stopped answering."""

    name = "watchdog"

    stall_seconds: float | str | None
    stall_action: str
    counters: RunCounters
    gate: PolicyGate
    calls: CallsInFlight
    stop: StopControl
    bridge: Bridge
    status: StatusReporter
    emit: Callable[[RunEvent], None]
    clock: Callable[[], float]
    rollouts_in_flight: Callable[[float], tuple[RolloutInFlight, ...]]
    workers_running: Callable[[], int]
    ready: Callable[[], int]
    queue: Callable[[], GroupQueueStatistics]

    def __post_init__(self) -> None:
        #: The threshold in force (read by the blocked-loop thread).
        self.threshold_s = STALL_FLOOR_SECONDS
        self._threshold_rule = ""
        #: Blocked-loop reports the thread made, for the loop to deliver once it runs again.
        self._delivered: list[StallReport] = []
        self._wake = anyio.Event()
        #: Wall time the thread's unanswered ping was sent (None: answered).
        self._pending: float | None = None
        #: The loop's clock and the wall clock when it last answered.
        self._answered = (0.0, 0.0)

    async def __call__(self) -> None:
        stop = self.stop
        if self.stall_seconds is None:
            await stop.finished.wait()
            return
        self._update_threshold()
        done = threading.Event()
        watcher = threading.Thread(
            target=self._ping_loop, args=(done, threading.get_ident(), _scheduler()),
            name="art_trio stall watchdog", daemon=True,
        )
        self._answered = (self.clock(), time.monotonic())
        watcher.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch)
                await stop.finished.wait()
                tg.cancel_scope.cancel()
        finally:
            done.set()
            watcher.join(timeout=5.0)
        # A blocked-loop report the run ended before delivering: still heard and counted.
        while self._delivered:
            report = self._delivered.pop(0)
            self.emit(Stalled(report.seconds, report))

    # -- the run's clock ------------------------------------------------------------------

    def _moved(self) -> tuple[int, int, int]:
        c = self.counters
        return c.rollouts_ended, c.steps, c.evals_ended

    def _update_threshold(self) -> float:
        setting = self.stall_seconds
        if setting is not None and setting != "auto":
            self.threshold_s = float(setting)
            self._threshold_rule = f"{self.threshold_s:g} s (set)"
            return self.threshold_s
        gate = self.gate
        times = [t for t in gate.snapshot().recent_rollout_times if t != float("inf")]
        measured = {
            "median rollout": statistics.median(times) if times else 0.0,
            "step period": gate.step_period or 0.0,
            "longest call": self.calls.longest_s,
        }
        longest = max(measured, key=lambda k: measured[k])
        derived = STALL_MULTIPLE * measured[longest]
        self.threshold_s = max(STALL_FLOOR_SECONDS, derived)
        shown = ", ".join(f"{k} {v:.1f} s" for k, v in measured.items())
        why = "the floor" if derived <= STALL_FLOOR_SECONDS else f"{STALL_MULTIPLE:g} x {longest}"
        self._threshold_rule = (
            f"{self.threshold_s:.1f} s (auto: {why}; max({STALL_FLOOR_SECONDS:g} s, "
            f"{STALL_MULTIPLE:g} x the longest of {shown}))"
        )
        return self.threshold_s

    async def _watch(self) -> None:
        moved = self._moved()
        last_move = self.clock()
        repeat = 0
        while True:
            threshold = self._update_threshold()
            with anyio.move_on_after(threshold / 4):
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = anyio.Event()
            while self._delivered:
                await self._act(self._delivered.pop(0))
            now = self._moved()
            if now != moved:
                moved, last_move, repeat = now, self.clock(), 0
                continue
            stalled = self.clock() - last_move
            if stalled >= threshold * 2**repeat:
                repeat += 1
                # Made in the loop, so the task tree can be read too.
                report = replace(
                    self._state(stalled, repeat, self.clock(), blocked=False),
                    tasks=task_tree(self.bridge.asyncio_loop),
                )
                self._say(report)
                await self._act(report)

    def _say(self, report: StallReport) -> None:
        """The log record and the line beside the status line (any thread)."""
        logger.warning("%s", report.text())
        self.status.write_line(f"[stalled] {report.headline()}")

    async def _act(self, report: StallReport) -> None:
        self.emit(Stalled(report.seconds, report))
        action = self.stall_action
        if action == "raise":
            raise PipelineStalled(report)
        if action == "stop" and not self.stop.stopping:
            logger.warning("Stopping the stalled run (stall_action='stop').")
            self.stop.request(graceful=True)

    # -- what each stage waits on ---------------------------------------------------------

    def _state(self, seconds: float, repeat: int, now: float, *, blocked: bool) -> StallReport:
        """The report: each stage, what is in flight, the queue and the gate."""
        rollouts = self.rollouts_in_flight(now)
        try:
            queue = self.queue()
        except RuntimeError:  # read from the watcher thread before the queue knew its clock
            queue = GroupQueueStatistics(0, 0, 0, 0, 0, 0, 0.0)
        gate = self.gate
        workers = self.workers_running()
        waiting = max(0, workers - len(rollouts) - queue.waiting_senders)
        snap = gate.snapshot()
        headroom = gate.policy.headroom(snap)
        held = waiting and headroom <= 0 and not gate.closed
        hold = _hold(snap, gate.policy.headroom) if held else None
        if rollouts:
            oldest = rollouts[0]
            held_by = f" (held by {hold.rule})" if hold is not None else ""
            rollout_wait = StageWait(
                "rollout",
                f"{len(rollouts)} of {workers} workers in rollouts (oldest: scenario "
                f"{oldest.scenario_index}, {oldest.age_s:.1f} s), {waiting} waiting at the "
                f"gate{held_by}, {queue.waiting_senders} blocked on the full groups queue",
                oldest.age_s,
            )
        elif queue.waiting_senders:
            rollout_wait = StageWait("rollout", f"{queue.waiting_senders} workers blocked on "
                                     "the full groups queue (training does not take groups)")
        elif hold is not None:
            rollout_wait = StageWait("rollout", f"{waiting} workers held at the gate by "
                                     f"{hold.rule} ({hold.short})")
        else:
            rollout_wait = StageWait("rollout", f"{waiting} workers waiting at the gate or on "
                                     "the scenario source" if waiting else "idle")
        if gate.closed:
            gate_text = "closed (the run is ending: no rollout starts)"
        elif hold is not None:
            gate_text = f"holds {waiting} workers: {hold.why}"
        elif math.isinf(headroom):
            gate_text = "admits any number of rollouts now"
        else:
            gate_text = f"admits {max(0, int(headroom))} more rollouts now"
        capacity = "unbounded" if queue.capacity == float("inf") else f"{queue.capacity:g}"
        return StallReport(
            seconds=seconds,
            threshold_s=self.threshold_s,
            threshold_rule=self._threshold_rule,
            repeat=repeat,
            blocked_loop=blocked,
            stages=(
                rollout_wait,
                self._stage_wait("training", now, idle="idle (not collecting, not training)"),
                self._stage_wait("eval", now, idle="idle"),
            ),
            rollouts=rollouts,
            calls=self.calls.in_flight(now),
            queue=(
                f"{queue.queued}/{capacity} queued, {queue.waiting_senders} workers blocked "
                f"handing over, {queue.waiting_receivers} receivers waiting, oldest group "
                f"{queue.oldest_age_s:.1f} s; {self.ready()} ready for a batch"
            ),
            gate=(
                f"policy version {gate.policy_version}, producing step "
                f"{gate.next_training_step}; {gate_text}; {gate.in_flight} in flight, "
                f"{gate.queued} groups queued"
            ),
        )

    def _stage_wait(self, stage: str, now: float, *, idle: str) -> StageWait:
        current = self.calls.innermost(stage)
        if current is None:
            return StageWait(stage, idle)
        call, since = current
        return StageWait(stage, call, now - since)

    # -- the blocked-loop thread ----------------------------------------------------------

    def _ping_loop(
        self, done: threading.Event, loop_thread: int,
        schedule: Callable[[Callable[[], None]], object],
    ) -> None:
        """The watcher thread: pings the loop and reports it blocked (see the module doc)."""
        repeat = 0
        while True:
            threshold = self.threshold_s
            if done.wait(min(PING_INTERVAL_S, threshold / 4)):
                return
            pending = self._pending
            now = time.monotonic()
            if pending is None:
                repeat = 0
                self._pending = now
                try:
                    schedule(self._answer)
                except Exception:  # the loop has ended: so has the run
                    return
            elif now - pending >= threshold * 2**repeat:
                repeat += 1
                loop_now, wall = self._answered
                self._blocked(now - pending, repeat, loop_now + (now - wall), loop_thread)

    def _answer(self) -> None:
        """In the loop, answering the ping; a blocked-loop report wakes the watch to emit and
        act on it."""
        self._answered = (self.clock(), time.monotonic())
        self._pending = None
        if self._delivered:
            self._wake.set()

    def _blocked(self, seconds: float, repeat: int, loop_now: float, thread_id: int) -> None:
        """In the watcher thread while the loop does not answer: report it now (log, status
        line), and hand the report to the loop for the event and the action."""
        try:
            report = self._state(seconds, repeat, loop_now, blocked=True)
        except Exception:  # the loop's state, read while it is blocked mid-change
            report = StallReport(
                seconds, self.threshold_s, self._threshold_rule, repeat, blocked_loop=True
            )
        frames, blocking = thread_stack(thread_id)
        report = replace(report, blocking_frames=frames, blocking_frame=blocking)
        # Queued before it is said: whoever unblocks the loop on hearing it finds it there.
        self._delivered.append(report)
        self._say(report)


@dataclass(frozen=True)
class _Hold:
    """Which admission rule holds the workers at the gate, in words."""

    rule: str
    #: A few words on what they wait for, and the whole reason.
    short: str
    why: str


def _hold(snap: GateSnapshot, headroom: Callable[[GateSnapshot], float]) -> _Hold:
    """Why admission refuses every rollout now (`headroom` is the policy's decision).

    A measuring policy may name a reason of its own (`GateSnapshot.held_by`: staleness-aware
    admission's load cap, where the freshness window has room and the shared server none).
    """
    version, step = snap.policy_version, snap.next_training_step
    if not reference_gate_allows(snap):
        return _Hold(
            "the staleness bound", "waiting for a policy",
            f"the staleness bound admits no rollout at policy version {version} until step "
            f"{step} is published (waiting for a policy)",
        )
    measured = snap.held_by(headroom)
    if measured is not None:
        return _Hold(*measured)
    waits = (
        f"waiting for a policy: step {step} is training" if snap.training
        else f"waiting for the batch of step {step + 1} to be taken"
    )
    return _Hold(
        "the freshness window", waits,
        f"the freshness window is full: {snap.queued} groups queued and {snap.fresh_in_flight} "
        f"rollouts in flight already fill the batches still to be taken ({waits})",
    )


def _scheduler() -> Callable[[Callable[[], None]], object]:
    """How another thread hands a function to the running loop."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe
