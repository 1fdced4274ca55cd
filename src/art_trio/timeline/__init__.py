"""See a run: its events recorded to a log, drawn as a picture and as a Perfetto trace.

    from art_trio.timeline import record_timeline

    with record_timeline(trainer, "run.jsonl"):
        await trainer.train()

then `art-trio timeline run.jsonl --png run.png --trace run.json` (or `load_timeline`, `draw`,
`write_trace`). Built on the public observer events only; drawing reads the log, never a run.
The picture needs matplotlib (`pip install 'art-trio[plot]'`), imported only when `draw` is called.
"""

from __future__ import annotations

from .draw import draw
from .lanes import Lanes
from .log import FORMAT, VERSION, LogWriter
from .model import FATES, Band, Rollout, RunTimeline, StepAges, load_timeline
from .read import TimelineError
from .recorder import TimelineRecorder, record_timeline
from .trace import trace_events, write_trace

__all__ = [
    "FATES",
    "FORMAT",
    "VERSION",
    "Band",
    "Lanes",
    "LogWriter",
    "Rollout",
    "RunTimeline",
    "StepAges",
    "TimelineError",
    "TimelineRecorder",
    "draw",
    "load_timeline",
    "record_timeline",
    "trace_events",
    "write_trace",
]
