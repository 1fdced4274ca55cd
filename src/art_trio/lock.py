"""One run per model directory: an OS lock that dies with the process holding it.

Two runs writing one directory's resume state train scenarios twice (each takes what the
other already trained) and can read each other's half-written files. `RunLock` takes an
exclusive `fcntl.flock` on `art_trio.lock` in the model's output directory before anything
is read, and keeps it until the last state write of the run is done.

Why flock:
- the kernel releases it when the process dies, however it dies (kill -9, OOM): no stale
  lock to clean up, ever;
- it belongs to the open file description, so a second `open()` of the same file in the
  *same* process conflicts too: two trainers on one model in one program are refused like two
  processes are;
- taken with LOCK_NB it never waits: a second run fails at once instead of queueing behind
  the first.

The file's content (pid, host, start time, command line) only names the holder in the error;
the lock itself is the flock, never the file's existence, so the file is left in place.
flock is advisory and, on NFS, emulated with byte-range locks by Linux (still exclusive
between clients on NFSv4); it is not available on Windows.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "art_trio.lock"


class RunLockedError(RuntimeError):
    """Another run holds the model directory: this one must not read or write its state."""

    def __init__(self, directory: Path, holder: str) -> None:
        self.directory = directory
        self.holder = holder
        super().__init__(
            f"another art_trio run is training in {directory} ({holder}). Only one run may "
            "use a model directory at a time: two would train the same scenarios twice. Wait "
            "for it to end or stop it (SIGINT/SIGTERM, or request_stop()); to run both, give "
            "this one another model name or project. The lock is released by the kernel when "
            "that process exits, even on kill -9, so there is never a stale lock to delete."
        )


class RunLock:
    """An exclusive, non-blocking lock on one model directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_FILE

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise RunLockedError naming the holder; never waits."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        if fcntl is None:  # pragma: no cover - Windows
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise RunLockedError(self.directory, holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            _write_holder(fd)
        except OSError:
            # Naming the holder is a courtesy (the disk may be full); the flock is the lock.
            pass

    def release(self) -> None:
        """Give the lock up (closing the descriptor releases the flock). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _holder_info() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "argv": sys.argv,
    }


def _write_holder(fd: int) -> None:
    data = (json.dumps(_holder_info()) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _describe_holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file (best effort)."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError):
        return "holder unknown: the lock file names no process yet"
    if not isinstance(info, dict):
        return "holder unknown"
    pid = info.get("pid")
    host = info.get("host")
    started = info.get("started")
    argv = info.get("argv")
    same_process = pid == os.getpid() and host == socket.gethostname()
    who = f"pid {pid} on {host}" + (" (this process: another trainer)" if same_process else "")
    command = " ".join(str(a) for a in argv) if isinstance(argv, list) else "?"
    return f"held by {who}, since {started}, command: {command}"


__all__ = ["LOCK_FILE", "RunLock", "RunLockedError"]
