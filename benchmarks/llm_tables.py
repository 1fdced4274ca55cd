"""The real-model scheduler benchmark's tables (``llm_scheduler_bench.py``), from its rows.

Kept apart from the benchmark, which loads torch and the model, so that
``results_tables.py`` renders the README's real-model rows from the committed JSON
(``benchmarks/results/llm-*.json``) with nothing heavy imported.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

#: The benchmark's arms (``llm_scheduler_bench.ARMS``) by name, ART's first: the ratios'
#: base.
LABELS = {"art": "ART", "art_trio": "art_trio", "art_trio_inflight": "art_trio in-flight"}


def mean_of(values: list[int]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| M | seed | trainer | wall s | steps | inference-s per trained group | rollout-s per "
        "trained group | started | wasted | cancelled | tokens generated | tokens aborted | "
        "tokens stale | tokens thrown away | tokens per trained token | "
        "mean policy age (token-weighted) | trainer utilization | inference share | "
        "time to target s | "
        "train s per step (load gauge) | load cap measured / held back / race capped | "
        "ended together (by cohort) | "
        "step rewards |"
    )
    lines = [header, "|" + "---|" * 23]
    for r in rows:
        lines.append(
            f"| {r['max_steps_off_policy']} | {r['seed']} | "
            f"{LABELS[r['kind']]} | {_fmt(r['wall_s'], '.0f')} | "
            f"{r['steps']}{' (timed out)' if r.get('timed_out') else ''} | "
            f"{_fmt(r['inference_s_per_trained_group'])} | "
            f"{_fmt(r['rollout_s_per_trained_group'])} | {r['rollouts_started']} | "
            f"{_fmt(r['wasted'], 'd')} | {r['cancelled']} | {r.get('tokens_generated', '-')} | "
            f"{r.get('tokens_aborted', '-')} | {r.get('tokens_stale', '-')} | "
            f"{r.get('tokens_thrown_away', '-')} | "
            f"{_fmt(r.get('scheduling_tokens_per_trained_token'))} | "
            f"{_fmt(r.get('token_policy_age'))} | {_fmt(r['trainer_utilization'])} | "
            f"{_fmt(r['inference_share_of_serial'])} | {_fmt(r['time_to_target_s'], '.0f')} | "
            f"{_fmt(r.get('training_s_per_step'), '.1f')} | "
            f"{r.get('load_model_measured', 0)} / {r.get('held_back_by_load_cap', 0)} / "
            f"{r.get('race_capped', 0)} | {r.get('ended_together', '-')} "
            f"({r.get('ended_together_by_cohort', '-')}) | "
            f"{' '.join(str(x) for x in r['step_rewards'])} |"
        )
    return "\n".join(lines)


def _mean(rows: list[dict[str, Any]], kind: str, key: str, m: int) -> float | None:
    """The mean of ``key`` over the arm's runs at max_steps_off_policy ``m`` (None if none
    has it: unreached, or not measured)."""
    values = [
        r[key]
        for r in rows
        if r["kind"] == kind
        and r["max_steps_off_policy"] == m
        and r.get(key) is not None
        and not (isinstance(r[key], float) and math.isnan(r[key]))
    ]
    return statistics.fmean(values) if values else None


def _reached(rows: list[dict[str, Any]], kind: str, m: int) -> tuple[int, int]:
    """(runs of the arm at ``m`` that reached the reward target, runs)."""
    runs = [r for r in rows if r["kind"] == kind and r["max_steps_off_policy"] == m]
    return sum(r["time_to_target_s"] is not None for r in runs), len(runs)


def ratios(rows: list[dict[str, Any]]) -> str:
    """Each arm against ART (the first arm) per max_steps_off_policy: means over seeds. The
    time-to-target ratio is over the seeds where both reached the target; a target counts as
    met only where the arm reached it at every seed."""
    out = [
        "| M | arm | inference-s per trained group (arm / ART) | tokens per trained token "
        "(arm / ART) | reached the reward target (arm, ART) | time to target (arm / ART, "
        "seeds both reached) | targets: <= 0.6 and <= 0.85 |",
        "|---|---|---|---|---|---|---|",
    ]
    base, *rest = LABELS
    others = [name for name in rest if any(r["kind"] == name for r in rows)]
    for m in sorted({r["max_steps_off_policy"] for r in rows}):
        for arm in others:
            inf = _mean_ratio(rows, arm, base, "inference_s_per_trained_group", m)
            waste = _mean_ratio(rows, arm, base, "scheduling_tokens_per_trained_token", m)
            ttt = _paired_ratio(rows, arm, base, "time_to_target_s", m)
            reached, runs = _reached(rows, arm, m)
            base_reached, base_runs = _reached(rows, base, m)
            met = (
                "not met"
                if reached < runs or inf is None or ttt is None
                else ("met" if inf <= 0.6 and ttt <= 0.85 else "not met")
            )
            out.append(
                f"| {m} | {LABELS[arm]} | {_fmt(inf)} | {_fmt(waste)} | {reached}/{runs}, "
                f"{base_reached}/{base_runs} | {_fmt(ttt)} | {met} |"
            )
    return "\n".join(out)


def _mean_ratio(rows: list[dict[str, Any]], kind: str, base: str, key: str, m: int) -> float | None:
    """Mean of ``key`` for ``kind`` over mean for ``base``, each over all its runs at ``m``."""
    a, b = _mean(rows, kind, key, m), _mean(rows, base, key, m)
    return a / b if a is not None and b else None


def _paired_ratio(
    rows: list[dict[str, Any]], kind: str, base: str, key: str, m: int
) -> float | None:
    """Mean of ``key`` for ``kind`` over mean for ``base``, over the seeds where both have it."""

    def by_seed(name: str) -> dict[int, float]:
        return {
            r["seed"]: r[key]
            for r in rows
            if r["kind"] == name and r["max_steps_off_policy"] == m and r[key] is not None
        }

    a, b = by_seed(kind), by_seed(base)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    return statistics.fmean(a[s] for s in seeds) / statistics.fmean(b[s] for s in seeds)


def _in_flight_floor(rows: list[dict[str, Any]], m: int) -> float | None:
    """The share of cancellation's tokens left without its stale and aborted ones: all an
    update in flight can save, so in-flight / cancellation cannot go below it."""
    generated = _mean(rows, "art_trio", "tokens_generated", m)
    stale, aborted = (_mean(rows, "art_trio", k, m) for k in ("tokens_stale", "tokens_aborted"))
    if not generated or stale is None or aborted is None:
        return None
    return 1 - (stale + aborted) / generated


def _tokens_per_trained_token(
    rows: list[dict[str, Any]], kind: str, m: int, *, own_waste: bool = True
) -> float | None:
    """Mean tokens generated over mean tokens trained; without `own_waste`, the stale and
    aborted tokens left out (what is left is paid by any trainer: the groups trained, those
    scored alike, the rollouts in flight at the end)."""
    generated, trained = (_mean(rows, kind, k, m) for k in ("tokens_generated", "tokens_trained"))
    stale, aborted = (_mean(rows, kind, k, m) or 0.0 for k in ("tokens_stale", "tokens_aborted"))
    if generated is None or not trained:
        return None
    return (generated - (0.0 if own_waste else stale + aborted)) / trained


def _token_ratios(rows: list[dict[str, Any]], m: int) -> tuple[float | None, float | None]:
    """art_trio's tokens per trained token over ART's, and the same with none of art_trio's
    own stale or aborted tokens: the floor its scheduler could reach on these runs."""
    art = _tokens_per_trained_token(rows, "art", m)
    if not art:
        return None, None
    mine = _tokens_per_trained_token(rows, "art_trio", m)
    floor = _tokens_per_trained_token(rows, "art_trio", m, own_waste=False)
    return (mine / art if mine is not None else None), (floor / art if floor is not None else None)


def _age_difference(rows: list[dict[str, Any]], m: int) -> float | None:
    """In-flight's mean token-weighted policy age minus cancellation's."""
    a, b = (_mean(rows, k, "token_policy_age", m) for k in ("art_trio_inflight", "art_trio"))
    return a - b if a is not None and b is not None else None


def in_flight_ratios(rows: list[dict[str, Any]]) -> str:
    """In-flight / cancellation (``art_trio``) per max_steps_off_policy, means over seeds."""
    out = [
        "| M | inference-s per trained group (in-flight / cancellation) | mean policy age "
        "(in-flight - cancellation) | time to target (in-flight / cancellation, seeds both "
        "reached) | tokens thrown away (in-flight / cancellation) | tokens per trained token "
        "(in-flight / cancellation) | floor: cancellation's tokens without its stale and "
        "aborted ones |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in sorted({r["max_steps_off_policy"] for r in rows}):

        def ratio(key: str, m: int = m) -> float | None:
            return _mean_ratio(rows, "art_trio_inflight", "art_trio", key, m)

        out.append(
            f"| {m} | {_fmt(ratio('inference_s_per_trained_group'))} | "
            f"{_fmt(_age_difference(rows, m), '+.2f')} | "
            f"{_fmt(_paired_ratio(rows, 'art_trio_inflight', 'art_trio', 'time_to_target_s', m))}"
            f" | {_fmt(ratio('tokens_thrown_away'))} | "
            f"{_fmt(ratio('scheduling_tokens_per_trained_token'))} | "
            f"{_fmt(_in_flight_floor(rows, m))} |"
        )
    return "\n".join(out)


def _per_seed(rows: list[dict[str, Any]], kind: str, key: str, m: int, spec: str) -> str:
    runs = sorted(
        (r for r in rows if r["kind"] == kind and r["max_steps_off_policy"] == m),
        key=lambda r: r["seed"],
    )
    return " / ".join(_fmt(r.get(key), spec) for r in runs)


def summary(results: dict[str, Any], measured: str | None = None) -> str:
    """The README's table of one saved run (``--json``): per M and arm, means over seeds and
    the per-seed figures, then the issues' ratios, then what it was measured with
    (`measured`, where the rows come from several runs: `summary_of_runs`)."""
    rows, meta = results["rows"], results["meta"]
    seeds = sorted({r["seed"] for r in rows})
    # Rows switch policy mid-decode only with in-flight updates: no column without that arm.
    switched = any(r["kind"] == "art_trio_inflight" for r in rows)
    columns = [
        "M", "trainer", "inference-s per trained group", "groups trained, scored alike",
        "tokens generated, thrown away", "token-weighted policy age",
        *(["rows switched mid-decode"] if switched else []),
        "steps (per seed)", "time to target s (per seed)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for m in sorted({r["max_steps_off_policy"] for r in rows}, reverse=True):
        for kind, label in LABELS.items():
            if not any(r["kind"] == kind and r["max_steps_off_policy"] == m for r in rows):
                continue

            def mean(key: str, kind: str = kind, m: int = m) -> float | None:
                return _mean(rows, kind, key, m)

            lines.append(
                f"| {m} | {label} | {_fmt(mean('inference_s_per_trained_group'))} | "
                f"{_fmt(mean('groups'), '.1f')}, {_fmt(mean('zero_variance_groups'), '.1f')} | "
                f"{_fmt(mean('tokens_generated'), ',.0f')}, "
                f"{_fmt(mean('tokens_thrown_away'), ',.0f')} | "
                f"{_fmt(mean('token_policy_age'))} | "
                + (f"{_fmt(mean('rows_updated_in_flight'), '.1f')} | " if switched else "")
                + f"{_per_seed(rows, kind, 'steps', m, 'd')} | "
                f"{_per_seed(rows, kind, 'time_to_target_s', m, '.0f')} |"
            )
    lines += ["", *_ratio_sentences(rows)]
    lines += [
        "",
        f"Means over seeds {', '.join(map(str, seeds))}, one run per seed and arm. "
        + (measured or f"Measured at {_provenance(meta)}."),
    ]
    return "\n".join(lines)


def _provenance(meta: dict[str, Any]) -> str:
    return (
        f"art_trio {meta['art_trio_revision']} on {meta['date'][:10]}, Python {meta['python']}"
        f" / ART {meta['openpipe-art']}, {meta['cpus']} cores (`{meta['command']}`)"
    )


def summary_of_runs(parts: list[dict[str, Any]]) -> str:
    """One table over saved runs of one command at different seeds (each run at its own
    commit), each run's provenance named with its seeds."""
    parts = sorted(parts, key=lambda part: min(r["seed"] for r in part["rows"]))
    rows = [row for part in parts for row in part["rows"]]
    measured = "; ".join(
        f"seed {', '.join(str(s) for s in sorted({r['seed'] for r in part['rows']}))} at "
        + _provenance(part["meta"])
        for part in parts
    )
    return summary({"rows": rows, "meta": parts[0]["meta"]}, measured=f"Measured: {measured}.")


def _ratio_sentences(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in sorted({r["max_steps_off_policy"] for r in rows}, reverse=True):
        parts = []
        inf = _mean_ratio(rows, "art_trio", "art", "inference_s_per_trained_group", m)
        ttt = _paired_ratio(rows, "art_trio", "art", "time_to_target_s", m)
        own = _mean_ratio(rows, "art_trio", "art", "scheduling_tokens_per_trained_token", m)
        if inf is not None:
            time = (
                f"time to target {_fmt(ttt)}x (<= 0.85; seeds both reached)"
                if ttt is not None
                else "time to target: no seed where both reached it"
            )
            tokens, floor = _token_ratios(rows, m)
            parts.append(
                f"art_trio / ART inference per trained group **{_fmt(inf)}x** (target <= 0.6; "
                f"tokens per trained token {_fmt(tokens)}x, its floor with none of its own "
                f"stale or aborted tokens {_fmt(floor)}x; groups scored alike left out: "
                f"{_fmt(own)}x), " + time
            )
        flight = _mean_ratio(
            rows, "art_trio_inflight", "art_trio", "inference_s_per_trained_group", m
        )
        if flight is not None:
            parts.append(
                f"in-flight / cancellation **{_fmt(flight)}x** (target <= 0.8; its floor, "
                "cancellation's tokens without its stale and aborted ones: "
                f"{_fmt(_in_flight_floor(rows, m))}), "
                f"policy age {_fmt(_age_difference(rows, m), '+.2f')} steps (<= +0.5)"
            )
        if parts:
            out.append(f"M={m}: " + "; ".join(parts) + ".")
    return out
