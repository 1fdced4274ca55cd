"""Benchmark ART 0.5.18's asyncio PipelineTrainer against art_trio's (see README.md here).

Thin wrapper around :func:`art_trio.bench.runner.main` (also ``art-trio bench``). Without
``--json``, results land in ``benchmarks/results/`` (gitignored) beside this script.

Note: ART's ``PipelineTrainer._validate_backend_support`` is patched to a no-op for the ``art``
kind, so it runs without torch (the check only concerns ART's LocalBackend).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# litellm (imported by ART) fetches a price map at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from art_trio.bench.runner import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--json" or a.startswith(("--json=", "--results-dir")) for a in argv):
        argv += ["--results-dir", str(Path(__file__).resolve().parent / "results")]
    sys.exit(main(argv))
