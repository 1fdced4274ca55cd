"""The results tables of README.md and docs/, written from committed benchmark results, never typed.

    python benchmarks/results_tables.py           # rewrite the tables
    python benchmarks/results_tables.py --check   # exit 1 if a document differs from them

The doubles table comes from benchmarks/baseline.json, the run the performance gate holds
every later run to (`python benchmarks/perf_gate.py --write-baseline` makes it). Each real-model
table comes from a saved run of `llm_scheduler_bench.py --json benchmarks/results/llm-NAME.json`
and is named `llm-NAME`. Each table names the commit, the versions and the command it was
measured with, and sits between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in one
or more of the documents below. Runs of one command at further seeds, saved as
`llm-NAME-seedK.json`, also make the table `llm-NAME-seeds`: every seed's rows, each run's
commit named.
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
from llm_tables import summary, summary_of_runs  # noqa: E402
from perf_gate import BASELINE, OVERHEAD, SCHEDULING, Figures, medians  # noqa: E402

ROOT = Path(__file__).parent.parent
#: The documents the tables are written into.
DOCUMENTS = (
    ROOT / "README.md", ROOT / "docs" / "agent-task.md", ROOT / "docs" / "real-model.md",
    ROOT / "docs" / "results.md",
)
#: Saved real-model runs, one table each.
LLM_RESULTS = Path(__file__).parent / "results"


def _label(spec: dict[str, Any]) -> str:
    batch = spec["min_batch"], spec["max_batch"]
    size = f"batch {batch[0]}" if batch[0] == batch[1] else f"batch {batch[0]}..{batch[1]}"
    return (
        f"{spec['name']} ({spec['workers']} workers, {spec['rollout_latency']}, {size}, "
        f"off-policy {spec['max_steps_off_policy']})"
    )


def _cells(figures: dict[str, dict[str, float]], metric: str, kinds: Sequence[str]) -> str:
    return " / ".join(f"{figures[k][metric]:.3f}" if k in figures else "n/a" for k in kinds)


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


def tables() -> dict[str, str]:
    """Every table, by name, from the committed results."""
    out = {"doubles": doubles_table(json.loads(BASELINE.read_text()))}
    runs: dict[str, list[Path]] = {}
    for path in sorted(LLM_RESULTS.glob("llm-*.json")):
        out[path.stem] = summary(json.loads(path.read_text()))
        runs.setdefault(re.sub(r"-seed\d+$", "", path.stem), []).append(path)
    for base, paths in runs.items():
        if len(paths) > 1:
            out[f"{base}-seeds"] = summary_of_runs([json.loads(p.read_text()) for p in paths])
    return out


def render(text: str, tables: dict[str, str]) -> str:
    """``text`` with each table's block rewritten (a block it does not hold is left alone)."""
    for name, table in tables.items():
        pattern = re.compile(
            rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.DOTALL
        )
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a document is not current")
    args = parser.parse_args(argv)
    wanted = tables()
    texts = {path: path.read_text() for path in DOCUMENTS}
    placed = {
        name for name in wanted for text in texts.values() if f"<!-- results:{name} -->" in text
    }
    if missing := sorted(set(wanted) - placed):
        raise SystemExit(f"no document has a <!-- results:NAME --> block for {missing}")
    stale = []
    for path, text in texts.items():
        new = render(text, wanted)
        if new == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(new)
    if args.check and stale:
        print(
            f"{', '.join(map(str, stale))}: results tables differ from the committed results: "
            "run `python benchmarks/results_tables.py` and commit them",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
