"""Child process: run one (trainer kind, workload) at one or more knob settings, write JSON.

Invoked by :mod:`art_trio.bench.runner` as ``python .../art_trio/bench/child.py SPEC OUT``
(by path, not ``-m``), one process per (kind, workload, seed) so peak RSS is per run.

For the ``art`` kind the ``art_trio`` package's ``__init__`` must not run: it imports
trio_asyncio, which patches ``asyncio.new_event_loop`` (and friends) process-wide, and ART's
``asyncio.run`` would then run on trio-asyncio's ``SyncTrioEventLoop`` at about twice the CPU
per group. So this file is run by path and, for ``art``, registers a bare ``art_trio`` package
(``__path__`` only) before importing ``art_trio.bench.trainers`` and ``art_trio.sim.workload``,
which import nothing else from art_trio. Each report's labels say whether trio_asyncio was
loaded and which event loop ran.

``SPEC`` is a JSON file::

    {"kind": "art", "workload": "plenty-off1", "overrides": {"seed": 0, "steps": 20},
     "points": [{}, {"max_rollouts_beyond_bound": 4}, ...]}

``OUT`` receives a JSON list with, per point, ``{"extra": ..., "report": ...}`` or
``{"extra": ..., "error": "..."}``. Peak RSS is only meaningful for the first point.
"""

from __future__ import annotations

import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any, cast

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def install_bare_package() -> None:
    """Make ``art_trio.<sub>`` importable without executing ``art_trio/__init__.py``."""
    if "art_trio" in sys.modules:
        return
    package = types.ModuleType("art_trio")
    package.__path__ = [str(_PACKAGE_DIR)]
    sys.modules["art_trio"] = package


def run_spec(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every point of ``spec`` in this process; errors become entries, not exceptions."""
    from art_trio.bench.trainers import Kind, UnsupportedKnob, run_one
    from art_trio.sim.workloads import PRESETS

    kind = cast(Kind, spec["kind"])
    overrides = dict(spec.get("overrides", {}))
    if "rss_checkpoints" in overrides:
        overrides["rss_checkpoints"] = tuple(overrides["rss_checkpoints"])
    workload = PRESETS[spec["workload"]].with_(**overrides)
    results: list[dict[str, Any]] = []
    for extra in spec.get("points", [{}]):
        try:
            report = run_one(kind, workload, extra)
        except UnsupportedKnob as exc:
            results.append({"extra": extra, "error": f"unsupported: {exc}"})
        except Exception as exc:  # report and go on with the other points
            results.append(
                {
                    "extra": extra,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
        else:
            results.append({"extra": extra, "report": report.to_dict()})
    return results


def main(argv: list[str] | None = None) -> int:
    """``child.py SPEC OUT``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python .../art_trio/bench/child.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    if spec["kind"] == "art":
        install_bare_package()
    results = run_spec(spec)
    Path(args[1]).write_text(json.dumps(results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    # Run by path, Python put this directory first on sys.path; its modules are meant to be
    # imported as art_trio.bench.*, not as top-level names.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.exit(main())
