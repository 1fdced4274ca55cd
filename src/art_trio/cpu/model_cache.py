"""The CPU backend's float32 model cache: a GGUF file's de-quantized conversion, kept so
later starts load it in seconds instead of converting again (about 2 minutes for SmolLM2).

Entries live under ``cache_root()`` (``ART_TRIO_MODEL_CACHE``, default
``~/.cache/art-trio/models``), one per GGUF file name and transformers version, keyed by the
file's content. The cache never stops the backend: ``write_entry`` turns every failure into a
warning, and ``art_trio.cpu.model_source`` deletes and rebuilds an entry that fails to load.
Writers hold a ``flock`` in their temporary directory, so a later start can tell a dead
writer's temporary (deleted) from a live one's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The file in a cache entry that says which GGUF file (by name) and transformers made it.
CACHE_SOURCE_FILE = "art-trio-source.json"
#: The lock file a cache writer holds (flock) in its temporary directory while it writes.
CACHE_WRITER_LOCK = ".writing"
#: A temporary without a writer's lock file (one cut short between creating the directory
#: and locking, or from an older art-trio) is stale after this long.
UNLOCKED_TEMPORARY_SECONDS = 3600.0


def cache_root() -> Path | None:
    """``ART_TRIO_MODEL_CACHE``, default ``~/.cache/art-trio/models``; None when ``off``."""
    root = os.environ.get("ART_TRIO_MODEL_CACHE", "")
    if root.lower() == "off":
        return None
    return Path(root) if root else Path.home() / ".cache" / "art-trio" / "models"


def content_key(path: Path) -> str:
    """``<size>-<sha256[:16]>`` of the file's bytes: the same GGUF gives the same key
    whatever its modification time (a reinstall, a copy); ~0.2 s for SmolLM2's 98 MB."""
    import hashlib

    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{path.stat().st_size}-{digest[:16]}"


def entry_dir(gguf: Path) -> Path | None:
    """Where ``gguf``'s float32 conversion is kept (see ``cache_root``; None when off).
    Keyed by the file's content (``content_key``), so a reinstall of the same file finds it
    and a changed file is converted again, and by the transformers version that converted
    it: versions write different tokenizer files (5.2's conversion, read by 5.12,
    mis-tokenizes every space)."""
    base = cache_root()
    if base is None:
        return None
    import transformers

    return base / f"{gguf.stem}-{content_key(gguf)}-transformers{transformers.__version__}"


def write_entry(cached: Path, gguf: Path, model: Any, tokenizer: Any) -> None:
    """Save the converted model for the next load. Every file is fsynced before the
    directory is renamed into place (a power loss never leaves a truncated entry); older
    entries for the same GGUF file name and transformers version are then deleted (one
    entry per model, whatever reinstalls happened). Any failure is a warning naming the
    cache and why, with the temporary removed: it only costs the next load's time."""
    import json
    import tempfile

    import transformers

    tmp: Path | None = None
    lock_fd: int | None = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        try:
            lock_fd = hold_lock(tmp / CACHE_WRITER_LOCK)
        except OSError:  # a filesystem without flock: the one-hour rule covers the temporary
            (tmp / CACHE_WRITER_LOCK).unlink(missing_ok=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / CACHE_SOURCE_FILE).write_text(
            json.dumps({"gguf_name": gguf.name, "transformers": transformers.__version__})
        )
        # Not part of the entry; the descriptor keeps the lock until the rename.
        (tmp / CACHE_WRITER_LOCK).unlink(missing_ok=True)
        _fsync_tree(tmp)
        if (cached / "config.json").is_file():
            # Another process converted the same bytes meanwhile: its entry is this one.
            logger.info("The model cache %s was written meanwhile; keeping it", cached)
            return
        remove_tree(cached)  # a partial directory (no config.json) is not an entry
        os.replace(tmp, cached)
        tmp = None
        _fsync_path(cached.parent)
        replaced = _replace_older_entries(cached, gguf)
        size = sum(f.stat().st_size for f in cached.rglob("*") if f.is_file())
    except Exception as exc:
        logger.warning(
            "Could not write the model cache %s (%s: %s): the backend runs from %s; the next "
            "start converts it again. Set ART_TRIO_MODEL_CACHE to a writable directory (or "
            "'off')",
            cached,
            type(exc).__name__,
            exc,
            gguf,
        )
        return
    finally:
        if tmp is not None:
            remove_tree(tmp)
        if lock_fd is not None:
            os.close(lock_fd)
    logger.warning(
        "Cached the float32 conversion of %s in %s (%s%s); later starts load it in "
        "seconds. ART_TRIO_MODEL_CACHE moves it, or =off turns it off",
        gguf.name,
        cached,
        f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} KB",
        f", replacing {len(replaced)} older entr{'y' if len(replaced) == 1 else 'ies'}"
        if replaced
        else "",
    )


def _replace_older_entries(cached: Path, gguf: Path) -> list[Path]:
    """Delete the cache's other entries for this GGUF file name and transformers version
    (older contents of the same model; entries of other transformers versions belong to
    other environments and stay). Returns what was deleted."""
    import json
    import re

    import transformers

    version = transformers.__version__
    # Entries written before content keys: ``<stem>-<size>-<mtime>-transformers<version>``.
    legacy = re.compile(rf"{re.escape(gguf.stem)}-\d+-\d+-transformers{re.escape(version)}")
    removed = []
    for entry in cached.parent.iterdir():
        if entry == cached or entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            meta = json.loads((entry / CACHE_SOURCE_FILE).read_text())
            same = meta == {"gguf_name": gguf.name, "transformers": version}
        except (OSError, ValueError):
            same = bool(legacy.fullmatch(entry.name))
        if same:
            remove_tree(entry)
            removed.append(entry)
    return removed


def hold_lock(path: Path) -> int:
    """Create ``path`` and hold an exclusive flock on it (released when this process ends,
    however it ends: how a later start tells a dead writer's temporary from a live one)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale_temporaries(root: Path) -> None:
    """Delete temporaries whose writer died (a kill -9 mid-write leaves ~0.5 GB): those
    whose lock file nobody holds, and unlocked ones older than an hour."""
    import fcntl
    import time

    try:
        temporaries = [p for p in root.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]
    except OSError:
        return
    for tmp in temporaries:
        try:
            fd = os.open(tmp / CACHE_WRITER_LOCK, os.O_RDWR)
        except FileNotFoundError:
            try:
                stale = time.time() - tmp.stat().st_mtime > UNLOCKED_TEMPORARY_SECONDS
            except OSError:
                continue
            if stale:
                logger.warning("Removing a stale model cache temporary %s", tmp)
                remove_tree(tmp)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer holds it
        else:
            logger.warning("Removing the temporary of a cache writer that died: %s", tmp)
            remove_tree(tmp)
        finally:
            os.close(fd)


def remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and ``root`` itself."""
    for path in root.rglob("*"):
        if path.is_file():
            _fsync_path(path)
    _fsync_path(root)
