"""The CPU backend's float32 model cache (issues 32.6, 32.8 and 35) on a real, tiny GGUF file.

``tests/tiny_llm.tiny_gguf`` writes a llama GGUF of about 100 KB: the conversion and the cache
run through transformers exactly as for SmolLM2's, in a second. Skipped without the llm extra;
not marked ``llm``.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_llm import TINY_MARKS, tiny_gguf

pytestmark = [
    *TINY_MARKS,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("gguf") is None, reason="needs the gguf package"
    ),
]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ART_TRIO_MODEL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def gguf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def gguf_file(gguf_template: Path, tmp_path: Path) -> Path:
    """The tiny GGUF, as a package installs it (a copy of its own)."""
    (tmp_path / "site-packages").mkdir()
    target = tmp_path / "site-packages" / "tiny.gguf"
    shutil.copyfile(gguf_template, target)
    shutil.copytree(gguf_template.parent / "tiny-hf", tmp_path / "site-packages" / "tiny-hf")
    return target


def _load(path: Path) -> tuple[object, object]:
    from art_trio.cpu import model_source

    return model_source.load(model_source.resolve(path))


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ------------------------------------------------------------------ 35: the key


def test_the_key_is_the_content_not_the_modification_time(
    gguf_file: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reinstall (the same bytes, a new mtime) finds the entry written before: one entry,
    and its writing said where and how big."""
    with caplog.at_level(logging.WARNING, "art_trio.cpu.model_source"):
        _load(gguf_file)
    [entry] = _entries(cache)
    written = [r.getMessage() for r in caplog.records if "Cached the float32" in r.getMessage()]
    assert len(written) == 1 and str(cache / entry) in written[0] and " KB" in written[0]
    os.utime(gguf_file, (1, 1))  # touched
    copy = tmp_path / "reinstalled" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf_file, copy)  # re-copied: a new inode and mtime
    caplog.clear()
    with caplog.at_level(logging.WARNING, "art_trio.cpu.model_source"):
        _load(gguf_file)
        _load(copy)
    assert _entries(cache) == [entry]
    assert not [r for r in caplog.records if "Cached" in r.getMessage()], "converted again"


def test_a_new_content_of_the_same_model_replaces_its_entry(gguf_file: Path, cache: Path) -> None:
    """A reinstall with other bytes converts again and deletes the old entry (and one of the
    mtime-keyed kind, from before); another transformers version's entry stays."""
    import transformers

    cache.mkdir()
    legacy = cache / f"tiny-87136-1764800000-transformers{transformers.__version__}"
    other_version = cache / "tiny-87136-1764800000-transformers4.0.0"
    for old in (legacy, other_version):
        old.mkdir()
        (old / "model.safetensors").write_bytes(b"\0" * 1000)
    _load(gguf_file)
    [first] = set(_entries(cache)) - {legacy.name, other_version.name}
    assert _entries(cache) == sorted([first, other_version.name])
    tiny_gguf(gguf_file, seed=1)  # the package reinstalled at a new version
    _load(gguf_file)
    [second] = set(_entries(cache)) - {other_version.name}
    assert second != first and second.startswith("tiny-")


# ------------------------------------------------------------------ 32.6: an unwritable cache


def test_an_unwritable_cache_is_a_warning_and_the_backend_starts(
    gguf_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from art_trio.cpu import CPUBackend

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("ART_TRIO_MODEL_CACHE", str(blocker / "models"))
    backend = CPUBackend(gguf_file)
    with caplog.at_level(logging.WARNING, "art_trio.cpu.model_source"):
        backend._load()
    assert backend.tokenizer is not None
    [warning] = [r.getMessage() for r in caplog.records if "Could not write" in r.getMessage()]
    assert str(blocker / "models") in warning and "NotADirectoryError" in warning


@pytest.fixture
def full_cache_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real 64 KB tmpfs as the cache (root only): too small for the conversion."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.setenv("ART_TRIO_MODEL_CACHE", str(mount))
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_cache_disk_leaves_no_temporary(
    gguf_file: Path, full_cache_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The write fails inside safetensors (a SafetensorError, no OSError): a warning naming
    the entry, the model loaded from the GGUF, nothing left on the small disk."""
    with caplog.at_level(logging.WARNING, "art_trio.cpu.model_source"):
        model, _ = _load(gguf_file)
    assert model is not None
    assert _entries(full_cache_disk) == []
    [warning] = [r.getMessage() for r in caplog.records if "Could not write" in r.getMessage()]
    assert str(full_cache_disk) in warning and str(gguf_file) in warning


# ------------------------------------------------------------------ 32.8: corrupt and stale


def test_a_truncated_cache_entry_is_named_deleted_and_rebuilt(
    gguf_file: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _load(gguf_file)
    [entry] = _entries(cache)
    weights = cache / entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)  # what a rename without fsync can leave after a power loss
    with caplog.at_level(logging.WARNING, "art_trio.cpu.model_source"):
        model, _ = _load(gguf_file)
    assert model is not None
    [warning] = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert str(cache / entry) in warning
    assert _entries(cache) == [entry] and weights.stat().st_size == size


def test_a_killed_writers_temporary_is_removed_on_the_next_start(
    gguf_file: Path, cache: Path
) -> None:
    """A cache writer killed with -9 mid-write leaves its temporary; the next load removes
    it, and leaves a live writer's alone."""
    from art_trio.cpu.model_cache import CACHE_WRITER_LOCK, hold_lock

    cache.mkdir()
    dead = cache / ".tmp-dead"
    child = (
        "import os, signal, sys; from pathlib import Path; "
        "from art_trio.cpu.model_cache import hold_lock, CACHE_WRITER_LOCK; "
        "d = Path(sys.argv[1]); d.mkdir(); hold_lock(d / CACHE_WRITER_LOCK); "
        "(d / 'model.safetensors').write_bytes(b'0' * 4096); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    killed = subprocess.run([sys.executable, "-c", child, str(dead)], env=env)
    assert killed.returncode == -9 and (dead / "model.safetensors").is_file()
    live = cache / ".tmp-live"
    live.mkdir()
    fd = hold_lock(live / CACHE_WRITER_LOCK)
    try:
        _load(gguf_file)
        assert not dead.exists() and live.is_dir()
    finally:
        os.close(fd)


# ------------------------------------------------------------------ 35: progress bars


def test_no_progress_bars_when_stderr_is_not_a_terminal(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Captured stderr is a pipe, as a log file is: the conversion writes no bar."""
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("ART_TRIO_MODEL_CACHE", "off")
    assert not sys.stderr.isatty()
    enabled = hf_logging.is_progress_bar_enabled()
    _load(gguf_file)
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err and "de-quantizing" not in err, err[-300:]
    assert hf_logging.is_progress_bar_enabled() == enabled  # put back as it was


def test_an_entry_written_meanwhile_by_another_process_is_kept(
    gguf_file: Path, cache: Path
) -> None:
    """Two starts converting the same GGUF at once: the second to finish keeps the first's
    entry (the same bytes) rather than deleting it under a reader, and leaves no temporary."""
    from art_trio.cpu import model_cache

    model, tokenizer = _load(gguf_file)
    [entry] = _entries(cache)
    marker = cache / entry / "config.json"
    before = marker.stat().st_mtime_ns
    model_cache.write_entry(cache / entry, gguf_file, model, tokenizer)
    assert _entries(cache) == [entry] and marker.stat().st_mtime_ns == before
