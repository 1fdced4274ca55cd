"""Library users get the trainer without the demo's web server and plotting libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from art_trio import cli


def test_importing_art_trio_pulls_no_server_plotting_or_cluster_library() -> None:
    code = (
        "import os, sys; os.environ['LITELLM_LOCAL_MODEL_COST_MAP'] = 'True'\n"
        "import art_trio\n"
        "heavy = {'hypercorn', 'starlette', 'matplotlib', 'ray'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_demo_without_its_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unloaded = ("art_trio.demo", "art_trio.local_backend", "hypercorn")
    for name in [m for m in sys.modules if m.startswith(unloaded)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypercorn", None)  # import hypercorn -> not found
    assert cli.main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "hypercorn is not installed" in err
    assert "pip install 'art-trio[demo]'" in err
