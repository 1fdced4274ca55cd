"""The picture: one lane per worker slot, rollouts coloured by fate, the trainer beside them.

Upper panel: a row per lane with each rollout as a bar coloured by its fate; above them a row
of training calls and a row of evals as bands (a red edge: ended without a result), stalls
shaded, and each policy publish a thin vertical line across everything. Lower panel: each
trained group's age in steps (counted from its rollout's start version) and each step's
token-weighted mean age, against time, with each group's seconds queued on the right axis.
Reads a `RunTimeline` only (matplotlib's Agg backend, no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .model import FATES, Band, RunTimeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: A colour per fate (colour-blind-safe where it matters: trained vs thrown away).
COLOURS = {
    "trained": "#1b9e77",
    "stale": "#d95f02",
    "cancelled_stale": "#e7298a",
    "zero_variance": "#a6a6a6",
    "errored": "#000000",
    "dropped_at_stop": "#7570b3",
    "given_back": "#e6ab02",
    "unsettled": "#dddddd",
}
TRAIN_SHADES = ("#4a90d9", "#8cb8e8")
EVAL_SHADE = "#9b59b6"
LABELS = {
    "cancelled_stale": "cancelled (stale)",
    "zero_variance": "zero variance",
    "dropped_at_stop": "dropped at stop",
    "given_back": "given back",
}


def draw(
    run: RunTimeline,
    path: str | Path | None = None,
    *,
    title: str | None = None,
    dpi: int = 100,
    width: float = 12.0,
    until: float | None = None,
) -> Figure:
    """Draw `run`; save it as a PNG at `path` if given. `until`: the time axis's end in
    seconds since the run started (two runs drawn to one `until` compare by eye). Returns
    the figure: its upper axes hold one bar collection per fate, its `gid` the fate."""
    from matplotlib.figure import Figure

    lanes = max(run.lanes, 1)
    height = min(3.0 + 0.16 * lanes, 14.0)
    fig = Figure(figsize=(width, height + 2.2), dpi=dpi, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[height, 2.2])
    t0 = run.start

    fates = _draw_lanes(top, run, t0)
    trainer_row, eval_row = lanes + 0.5, lanes + 1.5
    _draw_bands(top, run.train_calls, t0, trainer_row, TRAIN_SHADES)
    _draw_bands(top, run.evals, t0, eval_row, (EVAL_SHADE,))
    _draw_stalls_and_publishes(top, bottom, run, t0)
    _label_rows(top, lanes, trainer_row, eval_row)
    _legend(top, fates)
    _title(top, run, title)

    _draw_staleness(bottom, run, t0)
    bottom.set_xlim(0, until if until is not None else max(run.end - t0, 1e-6))
    if path is not None:
        # A PNG at exactly `path`: without the format, a name with no suffix would get .png.
        fig.savefig(path, dpi=dpi, format="png")
    return fig


def _draw_lanes(top: Axes, run: RunTimeline, t0: float) -> list[str]:
    """Each rollout as a bar on its lane, coloured by its fate; returns the fates drawn."""
    from matplotlib.collections import PolyCollection

    by_fate: dict[str, list[tuple[float, float]]] = {}
    rows: dict[str, list[int]] = {}
    for r in run.rollouts:
        by_fate.setdefault(r.fate, []).append((r.start - t0, max(r.end - r.start, 1e-9)))
        rows.setdefault(r.fate, []).append(r.lane)
    drawn = [fate for fate in FATES if fate in by_fate]
    for fate in drawn:
        # One collection per fate (its bars on their lanes): the legend and the tests read it.
        bars = [
            [(x, lane + 0.1), (x + w, lane + 0.1), (x + w, lane + 0.9), (x, lane + 0.9)]
            for (x, w), lane in zip(by_fate[fate], rows[fate], strict=True)
        ]
        top.add_collection(
            PolyCollection(
                bars,
                facecolors=COLOURS[fate],
                # A thin edge a shade off the fill: back-to-back rollouts on a lane stay
                # apart, and a bar too short for its fill still shows.
                edgecolors=[_edge(COLOURS[fate])],
                linewidths=0.6,
                label=LABELS.get(fate, fate),
                gid=fate,
            )
        )
    return drawn


def _edge(colour: str) -> tuple[float, ...]:
    """`colour` 40% of the way to black, or to white if it is near black (errored)."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(colour)
    towards = 1.0 if sum(rgb) < 0.6 else 0.0
    return tuple(c + (towards - c) * 0.4 for c in rgb)


def _draw_bands(
    top: Axes, bands: tuple[Band, ...], t0: float, row: float, shades: tuple[str, ...]
) -> None:
    """A row of bands (training calls or evals), coloured by `shades` in turn (two for the
    training calls: back-to-back calls stay apart at any zoom); a red edge: ended without a
    result."""
    for number, band in enumerate(bands):
        top.broken_barh(
            [(band.start - t0, band.end - band.start)],
            (row, 0.8),
            facecolors=shades[number % len(shades)],
            edgecolors="white" if band.completed else "red",
            linewidth=0.5,
        )


def _draw_stalls_and_publishes(top: Axes, bottom: Axes, run: RunTimeline, t0: float) -> None:
    """Stalls shaded on the lanes; each publish a thin line across both panels."""
    for band in run.stalls:
        top.axvspan(band.start - t0, band.end - t0, color="red", alpha=0.12, lw=0)
    for t, _version in run.publishes:
        for ax in (top, bottom):
            ax.axvline(t - t0, color="#555555", lw=0.5, alpha=0.6)


def _label_rows(top: Axes, lanes: int, trainer_row: float, eval_row: float) -> None:
    # A label on every lane is unreadable past a dozen; about twelve are shown.
    step_label = max(1, lanes // 12)
    ticks = list(range(0, lanes, step_label))
    top.set_yticks([y + 0.5 for y in ticks] + [trainer_row + 0.4, eval_row + 0.4])
    top.set_yticklabels([f"slot {y}" for y in ticks] + ["train", "eval"], fontsize=7)
    top.set_ylim(0, eval_row + 1.0)


def _legend(top: Axes, fates: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=COLOURS[f], label=LABELS.get(f, f)) for f in fates] + [
        Patch(color=TRAIN_SHADES[0], label="backend.train"),
        Patch(color=EVAL_SHADE, label="eval"),
        Line2D([], [], color="#555555", lw=0.8, label="policy published"),
    ]
    # Figure legends "outside": the layout keeps them clear of every axis, its ticks and labels.
    top.figure.legend(handles=handles, loc="outside right upper", fontsize=8)


def _title(top: Axes, run: RunTimeline, title: str | None) -> None:
    counts = ", ".join(f"{n} {LABELS.get(f, f)}" for f, n in run.fate_counts().items() if n)
    steps, rollouts = many(len(run.steps), "step"), many(len(run.rollouts), "rollout")
    top.set_title((title or f"{run.trainer}: {steps}, {rollouts}") + f"\n{counts}", fontsize=9)


def many(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless `n` is one ("1 step", "0 steps", "6 steps"); the tools'
    other messages count with it too."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _draw_staleness(bottom: Axes, run: RunTimeline, t0: float) -> None:
    """The lower panel: ages on the left axis, seconds queued on the right, one legend."""
    _draw_ages(bottom, run, t0)
    waits = bottom.twinx()
    _draw_queue_waits(waits, run, t0)
    lines = bottom.get_legend_handles_labels()
    extra = waits.get_legend_handles_labels()
    bottom.figure.legend(
        lines[0] + extra[0], lines[1] + extra[1], loc="outside right lower", fontsize=7
    )


def _draw_ages(bottom: Axes, run: RunTimeline, t0: float) -> None:
    """Each trained group's age in steps, from its start and token-weighted, and each step's
    token-weighted mean age."""
    xs = [s.t - t0 for s in run.steps for _ in s.ages]
    ages = [a for s in run.steps for a in s.ages]
    bottom.scatter(xs, ages, s=6, color="#1b9e77", label="group age (steps, from its start)")
    trained_at = {s.step: s.t for s in run.steps}
    weighted = [
        (trained_at[r.step] - t0, r.age_tokens) for r in run.rollouts
        if r.age_tokens is not None and r.step in trained_at
    ]
    if weighted:
        wx, wy = zip(*weighted, strict=True)
        bottom.scatter(
            wx, wy, s=8, marker="+", color="#7570b3", label="group age (steps, token-weighted)"
        )
    token = [(s.t - t0, s.token_age) for s in run.steps if s.token_age is not None]
    if token:
        bottom.plot(
            *zip(*token, strict=True), color="#333333", lw=1, label="token-weighted age (batch)"
        )
    bottom.set_ylabel("age (steps)", fontsize=8)
    bottom.set_xlabel("seconds since the run started", fontsize=8)


def _draw_queue_waits(waits: Axes, run: RunTimeline, t0: float) -> None:
    """Each trained group's seconds queued (handed over until its batch was taken)."""
    wx = [s.t - t0 for s in run.steps for _ in s.queued_s]
    waits.scatter(
        wx,
        [w for s in run.steps for w in s.queued_s],
        s=6,
        marker="x",
        color="#d95f02",
        label="seconds queued",
    )
    waits.set_ylabel("queued (s)", fontsize=8, color="#d95f02")
