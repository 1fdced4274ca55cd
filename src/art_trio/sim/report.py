"""Tables and plots of simulation results (markdown tables: readable in a terminal, pasteable).

``run_table`` renders one :class:`~art_trio.sim.simulate.SimReport` as metric/value rows,
``sweep_table`` one row per swept combination with the cheapest marked, and ``plot_sweep``
draws trainer utilization and waste against the swept values with matplotlib's Agg canvas
(no display, no pyplot global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from art_trio.sim.measures import format_staleness
from art_trio.sim.simulate import SimReport, SweepResult, combinations

__all__ = ["format_duration", "plot_sweep", "run_table", "sweep_summary", "sweep_table"]


def format_duration(seconds: float) -> str:
    """``42 s``, ``12.5 min``, ``3.20 h`` (``n/a`` for NaN)."""
    if math.isnan(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _num(value: float, spec: str = ".3f") -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if r else ("-" * (w + 2))
            for w, r in zip(widths, right, strict=True)
        )
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def run_table(report: SimReport) -> str:
    """One run as a two-column markdown table."""
    r = report
    rows = [
        ("simulated wall time", format_duration(r.sim_wall_s)),
        ("train steps", f"{r.steps} ({_num(r.steps_per_hour, '.1f')} steps/h)"),
        ("groups trained", str(r.groups_trained)),
        ("trainer utilization", _num(r.trainer_utilization)),
        ("rollout-slot utilization", _num(r.rollout_slot_utilization)),
        ("rollouts started", str(r.rollouts_started)),
        ("wasted rollouts (completed, stale)", f"{r.wasted_rollouts} ({_pct(r.wasted_share)})"),
        ("cancelled rollouts (doomed)", str(r.cancelled_rollouts)),
        (
            "wasted rollout-seconds",
            f"{format_duration(r.wasted_rollout_s)} ({_pct(r.wasted_rollout_s_share)} of "
            f"{format_duration(r.rollout_s)})",
        ),
        ("rollout-seconds per trained group", format_duration(r.rollout_s_per_trained_group)),
        (
            "left at end of run",
            f"{r.end_of_run_rollouts} rollouts ({format_duration(r.end_of_run_rollout_s)})",
        ),
        ("failed / zero-variance", f"{r.failed_rollouts} / {r.zero_variance_groups}"),
        (
            "staleness of trained groups",
            f"{format_staleness(r.staleness)} (mean {_num(r.mean_staleness, '.2f')})",
        ),
        ("mean queue depth", f"{_num(r.mean_queue_depth, '.2f')} (max {r.max_queue_depth})"),
    ]
    if r.evals:
        rows.append(("evals", str(r.evals)))
    if r.stalled:
        rows.append(("STALLED", "cut short at the virtual time limit"))
    rows.append(("simulated in", f"{r.real_s:.2f} s wall" + ("" if r.virtual else " (real time)")))
    return _table(("metric", "value"), rows, (False, False))


def _value(value: Any) -> str:
    return "None" if value is None else str(value)


def sweep_table(result: SweepResult) -> str:
    """One markdown row per combination; the cheapest one reaching the target is starred."""
    keys = list(result.grid)
    header = [
        *keys,
        "trainer util",
        "slot util",
        "steps/h",
        "wall",
        "stale done",
        "cancelled",
        "wasted roll-s",
        "roll-s/group",
        "queue",
        "staleness",
        "",
    ]
    rows = []
    for index, (combo, r) in enumerate(zip(combinations(result.grid), result.reports, strict=True)):
        mark = "* cheapest" if index == result.best else ("stalled" if r.stalled else "")
        rows.append(
            [
                *(_value(combo[k]) for k in keys),
                _num(r.trainer_utilization),
                _num(r.rollout_slot_utilization),
                _num(r.steps_per_hour, ".1f"),
                format_duration(r.sim_wall_s),
                _pct(r.wasted_share),
                str(r.cancelled_rollouts),
                _pct(r.wasted_rollout_s_share),
                format_duration(r.rollout_s_per_trained_group),
                _num(r.mean_queue_depth, ".1f"),
                _num(r.mean_staleness, ".2f"),
                mark,
            ]
        )
    right = [True] * (len(header) - 1) + [False]
    return _table(header, rows, right)


def sweep_summary(result: SweepResult) -> str:
    """One sentence naming the cheapest setting (or saying that none reached the target)."""
    best = result.best_report
    if best is None or result.best is None:
        top = max(
            range(len(result.reports)),
            key=lambda i: _sortable(result.reports[i].trainer_utilization),
        )
        combo = list(combinations(result.grid))[top]
        return (
            f"No setting kept trainer utilization >= {result.target:g}; the highest was "
            f"{_num(result.reports[top].trainer_utilization)} with {_settings(combo)}."
        )
    combo = list(combinations(result.grid))[result.best]
    return (
        f"Cheapest setting with trainer utilization >= {result.target:g}: {_settings(combo)} "
        f"(utilization {_num(best.trainer_utilization)}, "
        f"{format_duration(best.rollout_s_per_trained_group)} of rollouts per trained group, "
        f"{_pct(best.wasted_rollout_s_share)} of rollout-seconds wasted)."
    )


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def _settings(combo: dict[str, Any]) -> str:
    return " ".join(f"{k}={_value(v)}" for k, v in combo.items())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_sweep(result: SweepResult, path: str | Path) -> Path:
    """Draw trainer utilization (with the target) and waste against the first swept setting.

    One line per combination of the other swept settings. Numeric values are placed on a
    numeric axis (logarithmic when they span 8x or more), others side by side. Returns the
    PNG's path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = list(result.grid)
    x_key, other_keys = keys[0], keys[1:]
    x_values = result.grid[x_key]
    numeric = all(_is_number(v) for v in x_values)
    positions: dict[Any, float] = {}
    for i, v in enumerate(x_values):
        positions[repr(v)] = float(v) if numeric else float(i)

    series: dict[str, list[tuple[float, SimReport]]] = {}
    for combo, report in zip(combinations(result.grid), result.reports, strict=True):
        label = _settings({k: combo[k] for k in other_keys}) or "simulated"
        series.setdefault(label, []).append((positions[repr(combo[x_key])], report))

    figure = Figure(figsize=(7.5, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for label, points in series.items():
        points.sort(key=lambda p: p[0])
        xs = [p[0] for p in points]
        top.plot(xs, [p[1].trainer_utilization for p in points], marker="o", label=label)
        bottom.plot(xs, [p[1].wasted_rollout_s_share for p in points], marker="o", label=label)
    top.axhline(
        result.target, color="grey", linestyle="--", linewidth=1, label=f"target {result.target:g}"
    )
    if result.best is not None:
        best_combo = list(combinations(result.grid))[result.best]
        top.plot(
            [positions[repr(best_combo[x_key])]],
            [result.reports[result.best].trainer_utilization],
            marker="*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label="cheapest",
        )
    top.set_ylabel("trainer utilization")
    top.set_ylim(0, 1.05)
    bottom.set_ylabel("wasted rollout-seconds (share)")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel(x_key)
    if numeric:
        low, high = min(map(float, x_values)), max(map(float, x_values))
        if low > 0 and high / low >= 8:
            bottom.set_xscale("log", base=2)
        bottom.set_xticks(sorted(positions.values()))
        bottom.set_xticklabels([_value(v) for v in sorted(x_values, key=float)])
    else:
        bottom.set_xticks(list(positions.values()))
        bottom.set_xticklabels([_value(v) for v in x_values])
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    figure.suptitle(str(result.reports[0].spec.get("description", "")), fontsize="medium")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out
