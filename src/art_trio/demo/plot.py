"""Reward-vs-step curves from an ART model's ``history.jsonl``, drawn to a PNG.

``read_rewards`` gives the curves as data; ``plot_rewards`` draws them with matplotlib's Agg
canvas (no display, no pyplot global state, safe in any thread or test).
"""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: The history keys plotted, and their legend labels.
SERIES: dict[str, str] = {
    # Train reward averages the groups trained on; the trainer drops groups whose answers all
    # scored the same, so near convergence it sits below the val reward.
    "train/reward": "train reward (groups trained on)",
    "val/reward": "val reward",
}


def read_rewards(history_path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train/reward": [(step, reward), ...], "val/reward": [...]}``, sorted by step.

    Rows are keyed by their ``"step"``; several rows for one step are averaged. Lines that are
    not JSON objects (a run killed mid-write) are skipped.
    """
    sums: dict[str, dict[int, float]] = {key: defaultdict(float) for key in SERIES}
    counts: dict[str, dict[int, int]] = {key: defaultdict(int) for key in SERIES}
    with open(history_path, encoding="utf-8") as history:
        for line in history:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            for key in SERIES:
                value = row.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    sums[key][step] += float(value)
                    counts[key][step] += 1
    return {
        key: [(step, sums[key][step] / counts[key][step]) for step in sorted(sums[key])]
        for key in SERIES
    }


#: Characters of the default 10-point title that fit one line of the 7-inch figure.
TITLE_WIDTH = 72


def fit_title(title: str, width: int = TITLE_WIDTH) -> str:
    """`title` broken into lines that fit the figure (a run's timestamped name plus the task
    ran past both edges, centred and cut): after the run's name first, then at spaces."""
    lines: list[str] = []
    for part in title.split(": ", 1) if len(title) > width else [title]:
        lines += textwrap.wrap(part, width) or [""]
    if len(lines) > 1 and ": " in title and len(title) > width:
        lines[0] += ":"
    return "\n".join(lines)


def plot_rewards(
    history_path: str | Path,
    out_path: str | Path,
    *,
    title: str = "yes/no/maybe on a CPU",
    optimum: float | None = 1.0,
) -> Path:
    """Draw train and val reward against step to ``out_path`` (PNG); return its path."""
    curves = read_rewards(history_path)
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"train/reward": {"alpha": 0.6}, "val/reward": {"marker": "o", "linewidth": 2}}
    for key, label in SERIES.items():
        points = curves[key]
        if points:
            steps, rewards = zip(*points, strict=True)
            ax.plot(steps, rewards, label=label, **styles[key])  # type: ignore[arg-type]
    if optimum is not None:
        ax.axhline(optimum, color="grey", linestyle=":", linewidth=1, label="optimum")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(fit_title(title), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
