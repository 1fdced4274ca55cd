"""Child process: run one (trainer kind, workload) at one or more knob settings, write JSON.

Invoked by :mod:`art_trio.bench.runner` as ``python -m art_trio.bench.child SPEC OUT``, one
process per (kind, workload, seed) so peak RSS is per run. ``SPEC`` is a JSON file::

    {"kind": "art", "workload": "plenty-off1", "overrides": {"seed": 0, "steps": 20},
     "points": [{}, {"max_rollouts_beyond_bound": 4}, ...]}

``OUT`` receives a JSON list with, per point, ``{"extra": ..., "report": ...}`` or
``{"extra": ..., "error": "..."}``. Peak RSS is only meaningful for the first point.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, cast

from art_trio.bench.trainers import Kind, UnsupportedKnob, run_one
from art_trio.sim.workload import PRESETS


def run_spec(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every point of ``spec`` in this process; errors become entries, not exceptions."""
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
        print("usage: python -m art_trio.bench.child SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    results = run_spec(spec)
    Path(args[1]).write_text(json.dumps(results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
