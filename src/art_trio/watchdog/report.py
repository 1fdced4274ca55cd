"""What the stall watchdog reports: where a run that stopped moving is waiting, as plain data.

A `StallReport` is built by the watchdog (stage.py) when no rollout ended, no step trained and
no eval ended for `stall_seconds`, or when the event loop itself stopped answering. It is
carried by the kernel's `Stalled` event and by `PipelineStalled`, and `text()` is what the log
record says. Plain frozen values: nothing in it refers back to the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..messages.errors import ArtTrioError
from ..messages.values import CallInFlight, RolloutInFlight


@dataclass(frozen=True, slots=True)
class StageWait:
    """One stage, and what it waits on."""

    stage: str
    #: What the stage waits on now, in words ("backend.train for step 3", "idle").
    waits_on: str
    #: Seconds it has waited on it (None: not known, or not waiting).
    since_s: float | None = None


@dataclass(frozen=True, slots=True)
class TaskFrame:
    """A task of the run's task tree and the line it is suspended at."""

    #: "trio" or "asyncio".
    kind: str
    name: str
    #: Depth in the trio task tree (0 for the root); 0 for asyncio tasks.
    depth: int
    #: The innermost frame of its await chain outside the event loop's machinery: the line
    #: that waits, "file:line in function" ("" if unknown).
    where: str
    #: The outermost frame of the chain outside art_trio and the loop's machinery: the
    #: user's code that made the call ("" if none, or the same as `where`).
    awaited_from: str = ""


@dataclass(frozen=True, slots=True)
class StallReport:
    """Where a stalled run waits: each stage, the calls and rollouts in flight, the task tree.

    `blocked_loop`: the event loop itself did not answer for `seconds` (a callback blocking
    it with synchronous code); then `blocking_frames` is the loop thread's stack, innermost
    last, and `blocking_frame` the innermost frame outside the standard library.
    """

    #: Seconds since the run last moved (a rollout, a step or an eval ended); for a blocked
    #: loop, wall seconds since it last answered.
    seconds: float
    #: The `stall_seconds` in force, and how it was decided ("600 s (auto: the floor)").
    threshold_s: float
    threshold_rule: str
    #: 1 for a stall's first report, 2 for the next while it persists, ...
    repeat: int
    blocked_loop: bool
    stages: tuple[StageWait, ...] = ()
    rollouts: tuple[RolloutInFlight, ...] = ()
    calls: tuple[CallInFlight, ...] = ()
    #: The groups queue: queued / capacity, blocked senders, the oldest group's age ("?":
    #: not read).
    queue: str = "?"
    #: The policy gate: versions, workers waiting, whether the bound holds them.
    gate: str = "?"
    tasks: tuple[TaskFrame, ...] = ()
    blocking_frames: tuple[str, ...] = ()
    blocking_frame: str = ""

    def headline(self) -> str:
        """One line: how long, and what the first waiting stage waits on."""
        if self.blocked_loop:
            return (
                f"the event loop has been blocked for {self.seconds:.1f} s (wall) by "
                f"synchronous code at {self.blocking_frame or 'an unknown frame'}"
            )
        waiting = "; ".join(f"{w.stage}: {w.waits_on}" for w in self.stages if w.waits_on != "idle")
        return (
            f"the run has not moved for at least {self.seconds:.1f} s (no rollout ended, no step "
            f"trained, no eval ended): {waiting or 'every stage idle'}"
        )

    def text(self) -> str:
        """The whole report, as the log record and `PipelineStalled` give it."""
        lines = [
            f"art_trio stall report {self.repeat}: {self.headline()}",
            f"  stall_seconds: {self.threshold_rule}",
        ]
        for wait in self.stages:
            since = "" if wait.since_s is None else f" (for {wait.since_s:.1f} s)"
            lines.append(f"  {wait.stage}: {wait.waits_on}{since}")
        if self.rollouts:
            shown = ", ".join(
                f"scenario {r.scenario_index} ({r.age_s:.1f} s, worker {r.worker})"
                for r in self.rollouts[:16]
            )
            more = len(self.rollouts) - 16
            lines.append(
                f"  rollouts in flight ({len(self.rollouts)}, oldest first): {shown}"
                + (f", and {more} more" if more > 0 else "")
            )
        lines += [f"  call in flight: {c.stage}: {c.call} for {c.age_s:.1f} s" for c in self.calls]
        lines += [f"  groups queue: {self.queue}", f"  gate: {self.gate}"]
        if self.blocking_frames:
            lines.append("  the loop thread's stack (innermost last):")
            lines.extend(f"    {frame}" for frame in self.blocking_frames)
        if self.tasks:
            lines.append("  tasks (each at the line it waits on):")
            for task in self.tasks:
                indent = "  " * task.depth
                via = f" (from {task.awaited_from})" if task.awaited_from else ""
                lines.append(f"    {indent}{task.kind} {task.name} at {task.where or '?'}{via}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


class PipelineStalled(ArtTrioError, RuntimeError):
    """The run stopped moving for `stall_seconds` and `stall_action="raise"` ended it.

    `report` says where it waits (each stage, the calls and rollouts in flight, the task
    tree); the message is its text. The state was saved as on any failure: a retry of
    `train()` resumes, the batch in a hung `backend.train` settled against the backend's
    step, so nothing is trained twice or lost. A retry cannot mend a hung scenario source:
    a one-shot generator is read on from where it hung.
    """

    def __init__(self, report: StallReport) -> None:
        self.report = report
        super().__init__(
            f"{report.text()}\nThe run was ended (stall_action='raise'); its state is saved, "
            "so calling train() again resumes it. If what hung is the scenario source (a "
            "generator that stopped yielding), a retry waits on that generator again, or "
            "finds it closed (ScenarioSourceClosed): give a new trainer a new source, and "
            "the saved state skips what was trained."
        )
