"""One run per model directory: an OS lock that dies with the trainer's process, and only it.

Two runs writing one directory's resume state train scenarios twice (each takes what the
other already trained) and can read each other's half-written files. `RunLock` takes an
exclusive lock on `art_trio.lock` in the model's output directory before anything is read,
and keeps it until the last state write of the run is done.

Why a Linux open-file-description lock (`F_OFD_SETLK`), taken so that a fork cannot keep it:
- the kernel releases it when the last descriptor of its open file description closes,
  which a dying process does however it dies (kill -9, OOM): no stale lock to clean up;
- it belongs to the descriptor `RunLock` opened, not to the process: other code of the
  trainer's process opening and closing the lock file (a `shutil.copytree` of the model
  directory as a backup or an upload, a `grep -r` through `subprocess`) leaves it held. A
  classic POSIX record lock (`fcntl.lockf`) is dropped by closing *any* descriptor of the
  file in the process: a copy of the directory made during `backend.train` let a second run
  take the directory and both trained the same scenarios;
- a forked child shares the open file description, so the child's copy of the descriptor is
  closed at once in the child (`os.register_at_fork`; `O_CLOEXEC` covers `exec`): a helper
  forked by a rollout (multiprocessing's "fork" start method, `os.fork`, `subprocess`) never
  keeps the directory locked after a kill -9 of the trainer. A fork made in C without
  `exec` (no Python fork hooks run) would keep it until that child ends: the error then
  names the dead holder and says so;
- it works on NFS (through the NFS lock protocol). Where OFD locks do not exist (not Linux)
  the POSIX record lock is used, with its trap closed as well as it can be: see `check`.

Traps, closed here:
- POSIX locks do not conflict within one process: a registry of the lock files this process
  holds (by device and inode, so a symlinked path is the same directory) refuses a second
  trainer in the same program, in any thread, whichever lock is in use;
- with POSIX locks, a descriptor opened by a refused second `RunLock` of this process is
  kept open until the holder releases (closing it would drop the lock);
- the lock could still be lost (code closing every descriptor, or unlocking ours): `check`,
  run before every state write, reports a lost lock without taking it back, and the run
  stops with `RunLockLostError` rather than write its state over another run's.

The file's content (pid, host, start time, command line) only names the holder in the error;
the lock itself is the kernel's, never the file's existence, so the file is left in place.
The lock is advisory and not available on Windows. On a filesystem without locks (some FUSE
or SMB mounts) `acquire` raises `ModelDirectoryError` saying so; setting the environment
variable `ART_TRIO_RUN_LOCK=off` runs without the OS lock (this process still refuses a
second trainer; other processes are then not kept out: you must make sure of it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..messages.errors import ModelDirectoryError, RunLockedError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "art_trio.lock"

#: Whether the OS has open-file-description locks (Linux 3.15+); else POSIX record locks.
_OFD = fcntl is not None and sys.platform.startswith("linux") and hasattr(fcntl, "F_OFD_SETLK")

#: `struct flock` on Linux (l_type, l_whence, l_start, l_len, l_pid), whole file; l_pid must
#: be 0 for OFD locks.
_FLOCK = "hh4xqqi4x"

LOCK_ENV = "ART_TRIO_RUN_LOCK"
"""Set to `off` to run without the OS lock (a filesystem without lock support)."""

logger = logging.getLogger("art_trio")

#: What `fcntl` raises on a filesystem that has no locks (or refuses them).
_UNSUPPORTED = {
    errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EBADF,
}


def lock_disabled() -> bool:
    """Whether `ART_TRIO_RUN_LOCK` turns the OS lock off."""
    return os.environ.get(LOCK_ENV, "").strip().lower() in {"off", "0", "false", "no"}


@dataclass
class _Holding:
    """One lock file this process holds (see the registry below)."""

    pid: int
    #: The holder's descriptor: closed in a forked child, which must not keep the lock.
    fd: int
    #: Descriptors of the same file opened by refused RunLocks: closing one would drop the
    #: lock (POSIX semantics), so they are closed when the holder releases.
    extra_fds: list[int] = field(default_factory=list)


#: Lock files held by this process, by (device, inode). POSIX locks never conflict within one
#: process: this is what refuses a second trainer on the directory in the same program.
_HELD: dict[tuple[int, int], _Holding] = {}
_REGISTRY = threading.Lock()


def _forget_in_child() -> None:
    # A forked child holds none of the parent's POSIX locks; its copy of the registry would
    # make it refuse itself for the wrong reason, and the registry's lock may have been held
    # by another thread at the fork. Closing the child's copies of the descriptors is only
    # tidiness: the child holds no lock they could release.
    # A forked child shares the parent's OFD lock through its copy of the descriptor: closed
    # here, before the child's own code runs, so the child never keeps the directory locked
    # (a POSIX lock is not inherited at all; closing the copies is then only tidiness).
    global _REGISTRY
    _REGISTRY = threading.Lock()
    for holding in _HELD.values():
        for fd in (holding.fd, *holding.extra_fds):
            _close_quietly(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class RunLock:
    """An exclusive, non-blocking lock on one model directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._acquired = False
        self._pid = os.getpid()
        #: What `check` found lost the lock (None: held, or lost only with its file).
        self.lost: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_FILE

    @property
    def held(self) -> bool:
        """Whether `acquire` succeeded and `release` has not been called since."""
        return self._acquired

    def acquire(self) -> None:
        """Take the lock now or raise RunLockedError naming the holder; never waits.

        Raises ModelDirectoryError (naming the directory and what to do) if the directory
        cannot be created or written, is a file, or its filesystem has no locks.
        """
        if self._acquired:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        if fcntl is None:  # pragma: no cover - Windows
            self._acquired = True
            return
        self._make_directory()
        with _REGISTRY:
            fd = self._open()
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                holding = _HELD.get(key)
                if holding is not None and holding.pid == os.getpid():
                    holder = _describe_holder(fd)
                    # Not closed: that would drop the other trainer's lock (POSIX semantics).
                    holding.extra_fds.append(fd)
                    fd = -1
                    raise RunLockedError(self.directory, holder)
                if not lock_disabled():
                    self._lock(fd)
                _HELD[key] = _Holding(pid=os.getpid(), fd=fd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        self._fd, self._key, self._acquired, self._pid = fd, key, True, os.getpid()
        try:
            _write_holder(fd)
        except OSError:
            # Naming the holder is a courtesy (the disk may be full); the lock is the kernel's.
            pass

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:
            raise ModelDirectoryError(
                errno.ENOTDIR,
                f"the model directory {self.directory} exists but is not a directory (a file "
                "is in its place): art_trio keeps the run's lock and resume state there. Move "
                "the file away, or give the model another name or base_path",
                str(self.directory),
            ) from exc
        except OSError as exc:
            raise self._unwritable(exc) from exc

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._unwritable(exc) from exc

    def _unwritable(self, exc: OSError) -> ModelDirectoryError:
        return ModelDirectoryError(
            exc.errno or errno.EIO,
            f"cannot create or open {exc.filename or self.path} ({exc.strerror or exc}): "
            f"art_trio needs a writable model directory ({self.directory}) for the run's lock "
            "and resume state. Make it writable (a read-only mount, permissions, a path "
            "component that is a file), or give the model a writable base_path",
            str(self.directory),
        )

    def _lock(self, fd: int) -> None:
        assert fcntl is not None
        try:
            _os_lock(fd)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise RunLockedError(self.directory, _describe_holder(fd)) from None
            if exc.errno in _UNSUPPORTED:
                raise ModelDirectoryError(
                    exc.errno,
                    f"the filesystem of the model directory {self.directory} does not support "
                    f"file locks ({exc.strerror or exc}; some NFS, FUSE or SMB mounts), so "
                    "art_trio cannot make sure that only one run uses it (two would train the "
                    "same scenarios twice). Use a directory on a local filesystem (the model's "
                    f"base_path), or set the environment variable {LOCK_ENV}=off to run "
                    "without the lock if you make sure yourself that no other process trains "
                    "in this directory meanwhile",
                    str(self.directory),
                ) from exc
            raise

    def check(self) -> str | None:
        """None while this run holds the lock on the file at `path`; otherwise what happened.

        A deleted directory (a cleanup job, a wrong `rm -rf`) takes the lock file with it:
        another run could then lock a new file there while this one still writes. A lock
        found lost (see `lost`) is never taken back: another run may have come and gone.
        """
        if self._fd is None:
            return None
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} was deleted"
        except OSError as exc:
            return f"{self.path} can no longer be read ({exc.strerror or exc})"
        try:
            held = os.fstat(self._fd)
        except OSError:
            self.lost = f"its descriptor of {self.path} was closed by code in this process"
            return self.lost
        if (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino):
            return f"{self.path} was replaced by another file"
        if fcntl is None or lock_disabled():
            return None
        if _OFD:
            self.lost = self._check_ofd()
            return self.lost
        # POSIX record locks: code of this process that opened and closed the lock file
        # dropped it, and no probe can tell without dropping it again. Re-asserted: a no-op
        # while held; takes it back if free, or finds that another process took it.
        try:
            _os_lock(self._fd)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return (
                    f"the lock on {self.path} was lost (code in this process opened and "
                    "closed that file) and another run took it: " + _describe_holder(self._fd)
                )
        return None

    def _check_ofd(self) -> str | None:
        assert self._fd is not None
        if _ofd_conflicts(self._fd):
            # A lock of another open file description: someone else holds it, not us.
            return (
                f"the lock on {self.path} was lost (its descriptor was unlocked by code in "
                "this process) and another run took it: " + _describe_holder(self._fd)
            )
        # Nobody else holds it: either this descriptor does, or nobody at all.
        try:
            probe = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"{self.path} can no longer be read ({exc.strerror or exc})"
        try:
            held_by_us = _ofd_conflicts(probe)
        finally:
            os.close(probe)
        if held_by_us:
            return None
        return (
            f"the lock on {self.path} was lost (its descriptor was unlocked by code in this "
            "process); another run may have taken the directory and left meanwhile"
        )

    def release(self) -> None:
        """Give the lock up (closing the descriptor releases it). Idempotent."""
        fd, self._fd = self._fd, None
        key, self._key = self._key, None
        self._acquired = False
        self.lost = None
        if fd is None or self._pid != os.getpid():
            return  # a forked child's copy: its descriptor was closed at the fork
        with _REGISTRY:
            holding = _HELD.pop(key, None) if key is not None else None
            for extra in holding.extra_fds if holding is not None else ():
                _close_quietly(extra)
            os.close(fd)


def _os_lock(fd: int) -> None:
    # A seam for fault injection (a filesystem without locks).
    assert fcntl is not None
    if _OFD:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    else:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _ofd_conflicts(fd: int) -> bool:
    """Whether a lock held through another open file description (or process) than `fd`'s
    would keep `fd` from locking the whole file exclusively."""
    assert fcntl is not None
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)
    return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


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
    except OSError:
        raw = b""
    return _describe(raw)


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode("utf-8"))
    except ValueError:
        return "holder unknown: the lock file names no process yet"
    if not isinstance(info, dict):
        return "holder unknown"
    pid = info.get("pid")
    host = info.get("host")
    started = info.get("started")
    argv = info.get("argv")
    same_process = pid == os.getpid() and host == socket.gethostname()
    who = f"pid {pid} on {host}" + (" (this process: another trainer)" if same_process else "")
    if isinstance(pid, int) and host == socket.gethostname() and not _running(pid):
        # The kernel still holds the lock, so a descriptor of it outlived its process: a
        # child forked in C without exec (Python's own forks close it).
        who += (
            " (no longer running: a process it forked outside Python still holds the lock "
            f"file open; `fuser {LOCK_FILE}` in the directory names it)"
        )
    command = " ".join(str(a) for a in argv) if isinstance(argv, list) else "?"
    return f"held by {who}, since {started}, command: {command}"
