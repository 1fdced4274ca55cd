"""Aggregate run reports over seeds and format the benchmark's markdown tables."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from art_trio.sim.measures import RunReport, format_staleness


@dataclass
class Cell:
    """All runs of one (kind, workload, knob setting), over seeds, plus any errors."""

    kind: str
    workload: str
    extra: dict[str, Any]
    reports: list[RunReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def mean(self, attr: str) -> float | None:
        """Mean of a numeric report field over seeds, skipping None/NaN; None if none left."""
        values = [getattr(r, attr) for r in self.reports]
        finite = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        return statistics.fmean(finite) if finite else None

    def staleness(self) -> dict[int, int]:
        """Staleness histogram summed over seeds."""
        total: Counter[int] = Counter()
        for r in self.reports:
            total.update(r.staleness)
        return dict(sorted(total.items()))

    def mean_staleness(self) -> float | None:
        hist = self.staleness()
        n = sum(hist.values())
        return sum(k * v for k, v in hist.items()) / n if n else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "workload": self.workload,
            "extra": self.extra,
            "reports": [r.to_dict() for r in self.reports],
            "errors": self.errors,
        }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _rate_spec(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base == 0:
        return ""
    return f" ({value / base:.2f}x)"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    rows = [list(r) for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(r) for r in rows)
    return out


def main_table(cells: Sequence[Cell], workloads: Sequence[str], kinds: Sequence[str]) -> str:
    """Per workload and kind: rollout-seconds paid per trained group (what inference costs),
    throughput, utilization, waste, staleness, return latency, RSS.

    art_trio kinds carry their ratio to ART's value in parentheses.
    """
    by_key = {(c.workload, c.kind): c for c in cells if not c.extra}
    header = [
        "workload",
        "kind",
        "roll-s/group",
        "steps/s",
        "groups/s",
        "util",
        "waste",
        "cancelled",
        "wasted work",
        "staleness",
        "return s",
        "CPU us/group",
        "peak RSS MB",
    ]
    rows: list[list[str]] = []
    for wl in workloads:
        art = by_key.get((wl, "art"))
        for kind in kinds:
            cell = by_key.get((wl, kind))
            if cell is None:
                continue
            if not cell.reports:
                error = "error: " + (cell.errors[0] if cell.errors else "?")[:60]
                rows.append([wl, kind, error] + [""] * (len(header) - 3))
                continue
            base = art if (art is not None and kind != "art" and art.reports) else None

            def col(
                attr: str,
                spec: str | None,
                ratio: bool = True,
                cell: Cell = cell,
                base: Cell | None = base,
            ) -> str:
                value = cell.mean(attr)
                text = _rate_spec(value) if spec is None else _fmt(value, spec)
                if ratio and base is not None:
                    text += _ratio(value, base.mean(attr))
                return text

            rows.append(
                [
                    wl,
                    kind,
                    col("rollout_s_per_group", ".3f"),
                    col("steps_per_s", None),
                    col("groups_per_s", None),
                    col("utilization", ".3f"),
                    col("waste", ".3f"),
                    col("cancelled_share", ".3f", ratio=False),
                    col("wasted_work", ".3f"),
                    format_staleness(cell.staleness()),
                    col("return_latency_s", ".2f", ratio=False),
                    col("cpu_us_per_group", ".0f"),
                    col("peak_rss_mb", ".0f"),
                ]
            )
    return "\n".join(_table(header, rows))


def memory_table(cells: Sequence[Cell], workloads: Sequence[str], kinds: Sequence[str]) -> str:
    """Peak RSS at each checkpoint (trained groups) and at the end, per kind."""
    rows: list[list[str]] = []
    by_key = {(c.workload, c.kind): c for c in cells if not c.extra}
    for wl in workloads:
        for kind in kinds:
            cell = by_key.get((wl, kind))
            if cell is None or not cell.reports:
                continue
            samples = cell.reports[0].rss_mb
            points = ", ".join(f"{mb:.0f} MB @ {groups // 1000}k" for groups, mb in samples)
            growth = samples[-1][1] - samples[0][1] if len(samples) > 1 else 0.0
            rows.append([wl, kind, points, f"{growth:+.1f} MB"])
    if not rows:
        return ""
    return "\n".join(_table(["workload", "kind", "peak RSS @ trained groups", "growth"], rows))


def _setting(extra: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in extra.items()) or "default"


def _sweep_row(kind: str, setting: str, cell: Cell, art: Cell | None) -> list[str]:
    util, waste, work = cell.mean("utilization"), cell.mean("waste"), cell.mean("wasted_work")

    def delta(value: float | None, attr: str) -> str:
        base = art.mean(attr) if art is not None and art is not cell else None
        return "" if value is None or base is None else _fmt(value - base, "+.3f")

    return [
        kind,
        setting,
        _fmt(util, ".3f"),
        _fmt(waste, ".3f"),
        _fmt(cell.mean("cancelled_share"), ".3f"),
        _fmt(work, ".3f"),
        _rate_spec(cell.mean("groups_per_s")),
        _fmt(cell.mean_staleness(), ".2f"),
        delta(util, "utilization"),
        delta(waste, "waste"),
        delta(work, "wasted_work"),
    ]


def sweep_table(sweep: Sequence[Cell], main: Sequence[Cell], workloads: Sequence[str]) -> str:
    """Per workload: ART's single (util, waste) point, then each art_trio knob setting.

    Δ columns are the setting's value minus ART's: a setting with Δutil >= 0 and negative
    Δwaste/Δwork beats ART on both axes.
    """
    blocks: list[str] = []
    art_by_wl = {c.workload: c for c in main if c.kind == "art" and not c.extra and c.reports}
    header = [
        "kind",
        "setting",
        "util",
        "waste",
        "cancelled",
        "wasted work",
        "groups/s",
        "mean stale",
        "Δutil",
        "Δwaste",
        "Δwork",
    ]
    for wl in workloads:
        points = [c for c in sweep if c.workload == wl]
        if not points:
            continue
        art = art_by_wl.get(wl)
        rows: list[list[str]] = []
        if art is not None:
            rows.append(_sweep_row("art", f"(ART {metadata.version('openpipe-art')})", art, art))
        for c in points:
            if c.reports:
                rows.append(_sweep_row(c.kind, _setting(c.extra), c, art))
            else:
                error = "error: " + (c.errors or ["?"])[0][:50]
                rows.append([c.kind, _setting(c.extra), error] + [""] * (len(header) - 3))
        blocks.append(f"**{wl}**\n\n" + "\n".join(_table(header, rows)))
    return "\n\n".join(blocks)
