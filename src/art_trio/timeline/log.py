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
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

#: The header's `format`; a log without it is not a timeline log.
FORMAT = "art-trio-timeline"
#: The format's version: the reader refuses versions it does not know.
VERSION = 1
#: Buffered lines reach the file at least this often (wall seconds) while events come.
FLUSH_EVERY_S = 1.0

_ENCODERS: dict[type, Callable[[Any], str]] = {}
_MEMBERS: dict[enum.Enum, str] = {}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _json(value: Any) -> str:
    # The common scalars by hand: an event is written on every rollout, and json.dumps of a
    # whole record costs several times this.
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float and math.isfinite(value):
        return repr(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        text = _MEMBERS.get(value)
        if text is None:
            text = _MEMBERS[value] = json.dumps(_plain(value))
        return text
    return json.dumps(_plain(value))


def _stalled_fields(event: Any) -> dict[str, Any]:
    report = event.report
    return {
        "seconds": event.seconds,
        "repeat": int(getattr(report, "repeat", 0)),
        "blocked_loop": bool(getattr(report, "blocked_loop", False)),
    }


def event_fields(event: Any) -> dict[str, Any]:
    """A public event's fields as JSON values (see the module docstring)."""
    if type(event).__name__ == "Stalled":
        return _stalled_fields(event)
    return {f.name: _plain(getattr(event, f.name)) for f in dataclasses.fields(event)}


def encode_event(event: Any) -> str:
    """`"event":NAME,FIELD:VALUE,...`: an event's line without its time, by an encoder made
    once per event class."""
    kind = type(event)
    encoder = _ENCODERS.get(kind)
    if encoder is None:
        encoder = _ENCODERS[kind] = _encoder_for(kind)
    return encoder(event)


def encode_fields(name: str, fields: dict[str, Any]) -> str:
    """`encode_event`'s text for a line that is no run event (`RunStarted`, `RunEnded`)."""
    return json.dumps({"event": name, **fields}, separators=(",", ":"))[1:-1]


def _encoder_for(kind: type) -> Callable[[Any], str]:
    head = f'"event":{json.dumps(kind.__name__)}'
    if kind.__name__ == "Stalled":
        return lambda event: head + "," + json.dumps(_stalled_fields(event))[1:-1]
    names = tuple((f.name, json.dumps(f.name) + ":") for f in dataclasses.fields(kind))

    def encode(event: Any) -> str:
        return ",".join([head, *(key + _json(getattr(event, name)) for name, key in names)])

    return encode


class LogWriter:
    """Writes one log: the header at once, then `write(t, name, **fields)` per event.

    Lines are buffered, and reach the file when a caller marks one (`flush=True`: the
    recorder marks each step, publish, eval, stall and the run's end), when a second has
    passed since they last did, and on `close()`. A process killed mid-run leaves a log the
    reader can draw up to there: it lacks the events since, and perhaps has a last line cut
    short (which the reader names).
    """

    def __init__(self, path: str | Path, *, trainer: str = "art_trio", clock: str = "loop"):
        self.path = Path(path)
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
        header = {"format": FORMAT, "version": VERSION, "trainer": trainer, "clock": clock}
        try:
            # On disk at once: a log that cannot be written says so before anything runs.
            self._file.write(json.dumps(header) + "\n")
            self._file.flush()
        except OSError:
            self.close()
            raise
        self._flush_at = time.monotonic() + FLUSH_EVERY_S

    def write(self, t: float, name: str, *, flush: bool = False, **fields: Any) -> None:
        """One line: the time, the event's name and its fields (JSON values)."""
        self.write_encoded(t, encode_fields(name, fields), flush=flush)

    def write_encoded(self, t: float, body: str, *, flush: bool = False) -> None:
        """One line from `encode_event`'s text; `flush` sends it (and those before) to the
        file now."""
        if self._file is None:
            raise ValueError(f"the timeline log {self.path} is closed")
        self._file.write(f'{{"t":{t:.6f},{body}}}\n')
        if flush or time.monotonic() >= self._flush_at:
            self._file.flush()
            self._flush_at = time.monotonic() + FLUSH_EVERY_S

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()
