"""`art-trio demo --model`: routing and the errors a user without the model sees (no model is
loaded here; tests/test_cpu_llm.py runs the real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_trio.demo.cli import _explicit, main


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
