"""The pytest plugin (art_trio_pytest): the docs' example runs as a user's test file would, in
a pytest of its own, and catches the misconfiguration it is written to catch; the plugin is
registered by the entry point and costs runs that do not use it no import of art_trio."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import art_trio

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "property-testing.md"
MARK = "<!-- property-testing example"


def doc_example() -> str:
    """The guide's example test file: the ```python block after its marker."""
    text = DOC.read_text()
    assert MARK in text, f"{DOC}: the example's marker {MARK!r} is gone"
    after = text.split(MARK, 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def run_pytest(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    src = str(Path(art_trio.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    # -p art_trio_pytest: this tree's plugin, whether or not an installed art-trio registered
    # it (then pytest loads it once).
    command = [sys.executable, "-m", "pytest", "-p", "art_trio_pytest", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, "-q", "-rf", *args], cwd=path, env=env, capture_output=True, text=True,
        timeout=600,
    )


def test_the_guides_example_catches_the_misconfiguration(tmp_path: Path) -> None:
    (tmp_path / "test_my_pipeline.py").write_text(doc_example())
    done = run_pytest(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "FAILED test_my_pipeline.py::test_my_loss_sees_policy_lag_at_most_one" in out, out
    assert "PipelineCheckFailed: [policy age]" in out, out
    assert "max_steps_off_policy=4" in out, out
    assert "The case (minimal, after shrinking):" in out, out


def test_the_guides_fix_makes_it_pass(tmp_path: Path) -> None:
    """The fix the guide gives (max_steps_off_policy=1) passes both tests."""
    fixed = doc_example().replace(
        "eval_every_n_steps=5,", "eval_every_n_steps=5,\n    max_steps_off_policy=1,"
    )
    assert fixed != doc_example()
    (tmp_path / "test_my_pipeline.py").write_text(fixed)
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_a_run_not_using_the_plugin_imports_neither_art_trio_nor_hypothesis(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_other.py").write_text(
        "import sys\n\n"
        "def test_nothing_loaded():\n"
        "    loaded = {'art_trio', 'art', 'trio_asyncio'} & set(sys.modules)\n"
        "    assert not loaded, loaded\n"
    )
    done = run_pytest(tmp_path, "-p", "no:hypothesispytest")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_entry_point_names_the_plugin_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"art_trio_pytest": "art_trio_pytest"}
    import art_trio_pytest

    assert callable(art_trio_pytest.art_trio_pipeline)
