"""`art-trio demo --model`: routing and the errors a user without the model sees (no model is
loaded here; tests/test_cpu_llm.py runs the real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from art_trio.demo.cli import _explicit, main
from tests.llm_marks import LLM_MARKS

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_only_flags_given_override_the_real_model_demos_defaults() -> None:
    assert _explicit(["--model", "smollm2", "--steps", "3", "--no-plot"]) == {
        "model": "smollm2",
        "steps": 3,
        "no_plot": True,
    }


def test_a_missing_model_is_a_usage_error_naming_it_or_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model.gguf"
    assert main(["--model", str(missing), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # With the llm extra: the path is named; without it: the install command is.
    assert str(missing) in err or "pip install 'art-trio[llm]'" in err


def test_a_misspelt_model_name_is_named_before_any_extra_is_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model", "smollm"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'smollm2'?" in err
    assert "extra" not in err  # torch is not the problem, the name is


@pytest.mark.parametrize("flag", ["--worker", "--step", "--eval"])
def test_abbreviated_flags_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([flag, "3"])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {flag} 3" in capsys.readouterr().err


@pytest.mark.parametrize("model", [pytest.param("smollm2", marks=LLM_MARKS)])
def test_two_ctrl_c_during_the_first_model_load_exit_130_at_once(
    model: str, tmp_path: Path
) -> None:
    """Issue 32 item 9, with the real model: two Ctrl-C while `--model smollm2` loads end the
    process promptly, with one line each and exit status 130, no traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.getenv("PYTHONPATH")])),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "art_trio.demo", "--model", model, "--output-dir",
         str(tmp_path), "--no-plot"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    for line in child.stdout:  # printed once the load runs and Ctrl-C is answered
        if line.startswith("Loading"):
            break
    child.send_signal(signal.SIGINT)
    first = child.stderr.readline()
    assert "send SIGINT again to abandon it now" in first, first
    child.send_signal(signal.SIGINT)
    _, rest = child.communicate(timeout=60)
    assert child.returncode == 130
    assert rest.strip() == "art-trio demo: SIGINT: abandoned the model load; nothing was trained"


def test_a_tasks_own_demo_settings_apply_unless_given() -> None:
    pytest.importorskip("torch")
    from art_trio.demo.cli import llm_demo_options

    plain = llm_demo_options(["--model", "smollm2"])
    assert (plain.task, plain.workers, plain.max_steps_off_policy) == ("yes-no-maybe", 2, 1)
    agent = llm_demo_options(["--model", "smollm2", "--task", "lookup"])
    assert (agent.workers, agent.max_steps_off_policy) == (6, 3)
    given = llm_demo_options(["--model", "smollm2", "--task", "lookup", "--workers", "3"])
    assert (given.workers, given.max_steps_off_policy) == (3, 3)
    assert not llm_demo_options(["--model", "smollm2", "--no-plot"]).plot
