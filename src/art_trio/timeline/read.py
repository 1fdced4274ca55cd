"""Reading a timeline log back, with an error that names the file and what to do.

Every way a log can be unusable raises `TimelineError` (an `art_trio.ArtTrioError` and a
`ValueError`): no such file, an empty file, a first line that is not this format's header, a
version this reader does not know, a line that is not one JSON event (cut short by a process
that died, or edited by hand) or whose time is not a finite number. What each event's other
fields must be is checked where the model reads them (`model.py`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from art_trio import ArtTrioError

from .log import FORMAT, VERSION


class TimelineError(ArtTrioError, ValueError):
    """A timeline log cannot be read or drawn; the message names the file and the fix."""


def read_log(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the events of the log at `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TimelineError(
            f"{path}: no such file; record one with art_trio.timeline.record_timeline "
            "(or `art-trio simulate ... --timeline`)"
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise TimelineError(f"{path}: not a timeline log ({exc})") from None
    except OSError as exc:  # no permission, a symlink loop, an I/O error
        raise TimelineError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    lines = text.splitlines()
    if not lines:
        raise TimelineError(f"{path}: the file is empty; the run that wrote it never started")
    header = _header(path, lines[0])
    events = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        events.append(_event(path, number, line, last=number == len(lines)))
    return header, events


def _header(path: Path, line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TimelineError(
            f"{path}: line 1 is not a timeline log's header (expected "
            f'{{"format": "{FORMAT}", "version": {VERSION}, ...}}); is this the right file?'
        )
    if header.get("version") != VERSION:
        raise TimelineError(
            f"{path}: format version {header.get('version')!r} is not one this art_trio reads "
            f"(it reads version {VERSION}); draw it with the art_trio that recorded it"
        )
    return header


def _event(path: Path, number: int, line: str, *, last: bool) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        if last:
            raise TimelineError(
                f"{path}: line {number}, the last, is cut short ({exc.msg}): the recording "
                "process ended while writing; delete that line to draw the rest"
            ) from None
        raise TimelineError(f"{path}: line {number} is not JSON ({exc.msg})") from None
    except RecursionError:
        raise TimelineError(f"{path}: line {number} is nested too deeply to be an event") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("event"), str)
        or "t" not in record
    ):
        raise TimelineError(
            f'{path}: line {number} is not an event (expected {{"t": SECONDS, "event": NAME, '
            "...}})"
        )
    if not is_number(record.get("t")):
        raise TimelineError(
            f'{path}: line {number} ({record["event"]}) is garbled: "t" is '
            f"{shown(record['t'])}, not a finite number of seconds"
        )
    record["_line"] = number
    return record


def is_number(value: Any) -> bool:
    """A finite JSON number (true and false are no numbers; NaN and Infinity, which Python's
    json reads, are no times or ages)."""
    return type(value) in (int, float) and math.isfinite(value)


def shown(value: Any) -> str:
    """`value` as the log spells it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
