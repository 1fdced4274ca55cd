"""The README's results tables, written from the committed benchmark results, never typed.

    python benchmarks/results_tables.py           # rewrite the tables in README.md
    python benchmarks/results_tables.py --check   # exit 1 if README.md differs from them

The doubles table comes from benchmarks/baseline.json, the run the performance gate holds
every later run to (`python benchmarks/perf_gate.py --write-baseline` makes it); each table
names the commit and the versions it was measured with. A table sits between
`<!-- results:NAME -->` and `<!-- /results:NAME -->` in README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from perf_gate import BASELINE, OVERHEAD, SCHEDULING, Figures, medians  # noqa: E402

README = Path(__file__).parent.parent / "README.md"


def _label(spec: dict[str, Any]) -> str:
    batch = spec["min_batch"], spec["max_batch"]
    size = f"batch {batch[0]}" if batch[0] == batch[1] else f"batch {batch[0]}..{batch[1]}"
    return (
        f"{spec['name']} ({spec['workers']} workers, {spec['rollout_latency']}, {size}, "
        f"off-policy {spec['max_steps_off_policy']})"
    )


def _cells(figures: dict[str, dict[str, float]], metric: str, kinds: Sequence[str]) -> str:
    return " / ".join(
        f"{figures[k][metric]:.3f}" if k in figures else "n/a" for k in kinds
    )


def _measured(meta: dict[str, Any], command: str) -> str:
    return (
        f"Measured at art_trio {meta['art_trio_revision']} on {meta['date'][:10]}, Python "
        f"{meta['python']} / ART {meta['openpipe-art']}, {meta['cpus']} cores; median over "
        f"seeds ({command})."
    )


def doubles_table(results: dict[str, Any]) -> str:
    figures: Figures = medians(results)
    specs = results["workloads"]
    rows = [
        "| workload (mean rollout latency) | roll-s/group ART / trio / trio-native / asyncio "
        "| trainer util ART / trio / asyncio | wasted rollouts ART / trio |",
        "|---|---|---|---|",
    ]
    for name in SCHEDULING:
        f = figures[name]
        rows.append(
            f"| {_label(specs[name])} "
            f"| {_cells(f, 'rollout_s_per_group', ('art', 'trio', 'trio-native', 'asyncio'))} "
            f"| {_cells(f, 'utilization', ('art', 'trio', 'asyncio'))} "
            f"| {_cells(f, 'waste', ('art', 'trio'))} |"
        )
    rows += [
        "",
        "| scheduler overhead (zero-latency rollouts and training) | groups/s ART "
        "| trio (bridged) | trio-native | asyncio |",
        "|---|---|---|---|---|",
    ]
    for name in OVERHEAD:
        f = figures[name]
        art = f["art"]["groups_per_s"]
        cells = [
            f"{f[k]['groups_per_s']:,.0f} ({f[k]['groups_per_s'] / art:.2f}x)" if k in f else "n/a"
            for k in ("trio", "trio-native", "asyncio")
        ]
        rows.append(f"| {name} | {art:,.0f} | " + " | ".join(cells) + " |")
    rows += ["", _measured(results["meta"], "`python benchmarks/perf_gate.py --write-baseline`")]
    return "\n".join(rows)


def render(readme: str, tables: dict[str, str]) -> str:
    for name, table in tables.items():
        pattern = re.compile(
            rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.DOTALL
        )
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no <!-- results:{name} --> block to write into")
        readme = pattern.sub(
            lambda m, table=table: m.group(1) + table + "\n" + m.group(2), readme
        )
    return readme


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is not current")
    args = parser.parse_args(argv)
    tables = {"doubles": doubles_table(json.loads(BASELINE.read_text()))}
    current = README.read_text()
    wanted = render(current, tables)
    if args.check:
        if wanted != current:
            print(
                "README.md's results tables differ from benchmarks/baseline.json: run "
                "`python benchmarks/results_tables.py` and commit README.md",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
