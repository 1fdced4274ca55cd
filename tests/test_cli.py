"""The `art-trio` command itself, before any subcommand (art_trio.cli)."""

from __future__ import annotations

import subprocess
import sys

import art_trio


def test_version_prints_art_trios_version_without_importing_art() -> None:
    code = (
        "import sys\n"
        "from art_trio.cli import main\n"
        "status = main(['--version'])\n"
        "assert 'art' not in sys.modules, 'ART was imported'\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"art-trio {art_trio.__version__}\n"
