"""The event log's format: JSON Lines, a header line, then one event per line.

    {"format": "art-trio-timeline", "version": 1, "trainer": "art_trio", "clock": "loop"}
    {"t": 0.0, "event": "RunStarted", "policy_version": 0, "num_rollout_workers": 8, ...}
    {"t": 0.01, "event": "RolloutStarted", "scenario_index": 0}
    ...
    {"t": 42.5, "event": "RunEnded", "outcome": "returned"}

`t` is seconds on the recorder's clock (the event loop's: virtual under trio's MockClock).
An event's fields are the public event's fields (`art_trio.RolloutEnded`, ...), enums by value,
tuples as lists; `Stalled` keeps its seconds and what kind of stall it was, not the whole
report. `RunStarted` and `RunEnded` frame one `train()` call. Anything that can write these
lines (the recorder here, or a wrapper around another trainer) can be drawn.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import IO, Any

#: The header's `format`; a log without it is not a timeline log.
FORMAT = "art-trio-timeline"
#: The format's version: the reader refuses versions it does not know.
VERSION = 1

_FIELDS: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def event_fields(event: Any) -> dict[str, Any]:
    """A public event's fields as JSON values (see the module docstring)."""
    kind = type(event)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(event))
    if kind.__name__ == "Stalled":
        report = event.report
        return {
            "seconds": event.seconds,
            "repeat": int(getattr(report, "repeat", 0)),
            "blocked_loop": bool(getattr(report, "blocked_loop", False)),
        }
    return {name: _plain(getattr(event, name)) for name in names}


class LogWriter:
    """Writes one log: the header at once, then `write(t, name, **fields)` per event.

    Lines are buffered and flushed on `close()`: a process that dies leaves at most a last
    line cut short, which the reader reports as such.
    """

    def __init__(self, path: str | Path, *, trainer: str = "art_trio", clock: str = "loop"):
        self.path = Path(path)
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
        header = {"format": FORMAT, "version": VERSION, "trainer": trainer, "clock": clock}
        self._file.write(json.dumps(header) + "\n")

    def write(self, t: float, name: str, **fields: Any) -> None:
        if self._file is None:
            raise ValueError(f"the timeline log {self.path} is closed")
        record = {"t": round(t, 6), "event": name, **fields}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
