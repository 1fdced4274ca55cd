"""The resume state's files on disk: names, atomic whole-file replacement, the write seam
fault injection patches (`os_write`), reading a JSON file and parsing the journal's lines,
and the errors a failed write raises (`StateWriteError`, `ModelDirectoryLostError`)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from ..messages.errors import ModelDirectoryLostError, StateFileError

# The whole-file write, here with `os_write` as the seam fault injection patches.
from ..plumbing.files import atomic_write_json as atomic_write_json
from .state import PipelineState, _is_count

SIDECAR_FILE = "art_trio_state.json"
"""art_trio's own copy of the pipeline state, next to `state.json`.

ART's `model.log` rewrites `state.json` in place; a kill during that write leaves it torn.
This file is only ever replaced atomically, so resume never depends on ART's write.
"""

JOURNAL_FILE = "art_trio_journal.jsonl"
"""Per-step records newer than the snapshot; appended, never rewritten."""


def os_write(fd: int, data: bytes | memoryview) -> int:
    # A seam for fault injection (short writes, ENOSPC); real code is os.write.
    return os.write(fd, data)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None if missing; raises ValueError if it is not readable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data



JOURNAL_ADVICE = (
    "Restore the file, or delete it to resume from art_trio_state.json alone (the steps since "
    "that snapshot may then be trained again)."
)


def read_journal(path: Path) -> tuple[int, list[tuple[int, dict[str, Any]]]]:
    """The journal's length in whole records, and its records with their line numbers; a
    torn last line is left out (0 and none if the file is missing)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0, []
    # Everything up to the last newline is whole records; a torn tail is left out.
    whole = raw.rfind(b"\n") + 1
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if number == len(lines) and not raw.endswith(b"\n"):
            # Torn by a kill mid-append (a record is written with its newline in one
            # call, which had not returned): that step's train never started. Even if the
            # line parses, it is left out, as append() cuts it off.
            break
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise StateFileError(
                f"{path} line {number} is not valid UTF-8 JSON ({exc}); only "
                f"an unterminated last line can be torn by a crash. {JOURNAL_ADVICE}"
            ) from None
        if not isinstance(record, dict) or not _is_count(record.get("seq")):
            raise StateFileError(
                f"{path} line {number} is not an art_trio journal record "
                f"(an object with an integer `seq`), found {line[:80]!r}. "
                + JOURNAL_ADVICE
            )
        records.append((number, record))
    return whole, records


def directory_lost(
    output_dir: Path,
    state: PipelineState,
    problems: list[str],
    directory_gone: bool,
    failure: BaseException | None,
) -> ModelDirectoryLostError:
    """The error that stops a run whose directory or files vanished: what happened, and
    whether the resume state could be written there again (`failure`: why not)."""
    why = "; ".join(problems)
    if failure is not None:
        outcome = (
            f"art_trio could not write the run's resume state there again ({failure}): a "
            f"resume from {output_dir} as it is now would start at scenario 0 and "
            "train every scenario again. Restore the directory from a backup, or keep "
            "this error's step in mind and skip what was trained by hand"
        )
        code = failure.errno if isinstance(failure, OSError) and failure.errno else errno.ENOENT
    else:
        outcome = (
            f"art_trio wrote the run's resume state (training step {state.training_step}, "
            f"which scenarios are trained: every one below {state.ledger.watermark} and "
            f"{len(state.ledger.resolved_above)} above) into {output_dir} again, so a "
            "resume neither repeats nor skips a scenario."
        )
        if directory_gone:
            outcome += (
                " What else the directory held is gone and art_trio cannot bring it back: "
                "ART's checkpoints (with LocalBackend, the trained weights: the backend "
                "resumes from the step it still has), history.jsonl, logs. Restore them "
                "from a backup if you have one; to start over instead, train with "
                "resume=False"
            )
        code = errno.ENOENT
    what = (
        f"the model directory {output_dir} was deleted or replaced"
        if directory_gone
        else f"art_trio's files in the model directory {output_dir} were deleted or "
        "replaced"
    )
    return ModelDirectoryLostError(
        code,
        f"{what} while this run was training ({why or 'the directory is another one'}). "
        f"The run stops: nothing more is written to deleted files. {outcome}",
        str(output_dir),
    )
