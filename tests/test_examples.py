"""Every program in examples/ runs, with the small settings it ships with, and says what it did.

The guides include their Python from these files (mkdocs snippets), so a guide's code is
tested here. A new example without an entry in EXPECTED fails `test_every_example_is_run`.
Each runs in this process (as ``__main__``, from a temporary working directory, where it
writes its ``.art``), except the Ray one, which runs as its own process so that the Ray
instance it starts and stops cannot outlive it.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.loops import require_trio_asyncio_patched_anyio

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: example -> runs: (argv, patterns its output must match, in this order)
EXPECTED: dict[str, list[tuple[list[str], list[str]]]] = {
    "anyio_run.py": [
        ([], [r"training on asyncio: running=True", r"asyncio: trained 3 steps"]),
        (["trio"], [r"training on trio: running=True", r"trio: trained 3 steps"]),
    ],
    "art_script.py": [([], [r"trained to step 3"])],
    "autotune.py": [([], [r"workers: 64 -> (\d+) after 80 steps", r"step \d+: decrease_workers"])],
    "cancel_scope.py": [
        ([], [r"cancelled at step (\d+); running=False", r"resumed from step \d+ and trained"])
    ],
    "extensions.py": [
        (
            [],
            [
                r"8 workers, at most [123] rollouts in flight \(cap 3\)",
                r"stopped by the reward target at step \d+; trained \d+ steps",
            ],
        )
    ],
    "ray_rollouts.py": [([], [r"trained 3 steps, rollouts on 1 Ray node"])],
    "resume_after_crash.py": [
        (
            [],
            [
                r"killed the training process at step 2 \(exit status -9\)",
                r"resumed and trained to step 5: \d+ scenarios trained, none twice: True",
            ],
        )
    ],
    "see_a_run.py": [
        ([], [r"timeline: 4 steps, \d+ rollouts", r"spans: \{.*'art_trio\.train': 4"])
    ],
    "trio_services.py": [
        (
            [],
            [
                r"health while training: \{'running': True",
                r"trained 4 steps \(heard \[1, 2, 3, 4\]\), workers now 4",
            ],
        )
    ],
}

RUNS = [
    pytest.param(name, argv, patterns, id=f"{name}{''.join(' ' + a for a in argv)}")
    for name, runs in EXPECTED.items()
    for argv, patterns in runs
]


def test_every_example_is_run() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


def assert_in_order(out: str, patterns: list[str]) -> None:
    position = 0
    for pattern in patterns:
        match = re.compile(pattern, re.MULTILINE).search(out, position)
        assert match, f"{pattern!r} not found (in order) in:\n{out}"
        position = match.end()


@pytest.mark.parametrize(("name", "argv", "patterns"), RUNS)
def test_example_runs(
    name: str,
    argv: list[str],
    patterns: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = EXAMPLES / name
    if name == "ray_rollouts.py":
        out = run_ray_example(path, tmp_path)
    else:
        require_trio_asyncio_patched_anyio()
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(path), *argv])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            runpy.run_path(str(path), run_name="__main__")
        out = capsys.readouterr().out
        # Copied into a user's script, an example must not teach a deprecated spelling
        # (ART 0.5.20+ deprecates the runtime settings as keyword arguments).
        taught = [str(w.message) for w in caught
                  if issubclass(w.category, DeprecationWarning) and w.filename == str(path)]
        assert not taught, taught
    assert_in_order(out, patterns)
    if name != "ray_rollouts.py":
        assert (tmp_path / ".art" / "examples" / "models").is_dir()


def test_an_example_run_twice_starts_over(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A newcomer runs an example again: the second run is the first one again, from step 0,
    not a resume of the first run's fixed-name model (which warned that the saved state and
    the backend's step disagree, and trained steps 1-3 again on other scenarios)."""
    require_trio_asyncio_patched_anyio()
    path = EXAMPLES / "anyio_run.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")
    first = capsys.readouterr().out
    assert "starting over" not in first
    runpy.run_path(str(path), run_name="__main__")
    second = capsys.readouterr().out
    model_dir = Path(".art", "examples", "models", "anyio-asyncio")
    assert_in_order(second, [rf"starting over: removed {re.escape(str(model_dir))}",
                             r"asyncio: trained 3 steps"])  # fmt: skip
    assert not [r for r in caplog.records if "pipeline state was saved" in r.getMessage()]
    steps = [json.loads(line).get("step") for line in (tmp_path / model_dir / "history.jsonl")
             .read_text().splitlines()]  # fmt: skip
    assert min(s for s in steps if s is not None) <= 1 and max(steps) == 3, steps


def run_ray_example(path: Path, cwd: Path) -> str:
    pytest.importorskip("ray", reason="needs Ray: pip install -e '.[ray]'")
    # The child imports art_trio from this tree, as the tests do.
    path_entries = [str(EXAMPLES.parent / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path_entries))}
    done = subprocess.run(
        [sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if "Ray could not start here" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_art_script_passes_only_arts_own_trainer_arguments() -> None:
    """The port changes the import and nothing else: every keyword it gives the trainer is a
    parameter of the installed ART's own PipelineTrainer, and the import says what it replaced."""
    from art.pipeline_trainer import PipelineTrainer as ArtPipelineTrainer

    source = (EXAMPLES / "art_script.py").read_text()
    assert "from art_trio import PipelineTrainer  # was: from art.pipeline_trainer import" in source
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PipelineTrainer"
    ]
    assert len(calls) == 1
    keywords = {k.arg for k in calls[0].keywords}
    art_parameters = set(inspect.signature(ArtPipelineTrainer.__init__).parameters)
    assert keywords and keywords <= art_parameters, keywords - art_parameters
