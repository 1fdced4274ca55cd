"""The freshness rule: which policy versions a group's tokens came from, and their mean.

Policy, not bookkeeping: a group's token-weighted mean policy version is what ART 0.5.20's
`limit_mean_steps_off_policy` bounds (`batching.Freshness.is_stale` compares it), and the
per-token versions are what the train metrics weigh ages with. The rollout stage stamps a
group's versions with these functions before it hands the group over; the metrics read the
same ones. Knows no run and no stage: it reads trajectories only.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic
from art import Trajectory

from ..plumbing.compat import record_completion_tokens

_warned_missing_tokens = False

#: Where ART 0.5.20+'s servers say which policy version produced which of a completion's tokens.
SPANS_KEY = "policy_token_spans"

#: The `completion_tokens` types read without the general number test (exactly these: a
#: subclass, or a bool, takes the general way).
PLAIN_COUNTS = (int, float)


def _attribute(model: Any, name: str) -> Any:
    """`getattr(model, name, None)` without pydantic's slow miss.

    These rules read every trajectory of every group, twice; where the installed ART's
    `Trajectory` lacks a field or private attribute (0.5.18 has no `exchanges` and no
    `_policy_token_counts`), a plain getattr raises and catches an AttributeError inside
    pydantic's `__getattr__`, which cost the batch-32 overhead workload ~40% of its CPU.
    """
    if isinstance(model, pydantic.BaseModel):
        if name.startswith("_"):
            return (model.__pydantic_private__ or {}).get(name)
        return model.__dict__.get(name)
    return getattr(model, name, None)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def completion_weight(trajectory: Trajectory) -> float:
    """The trajectory's `completion_tokens` metric, or 1.0 (warned once) if it has none.

    NaN for a count no weight can stand for (infinite, NaN, negative): such a trajectory is
    rejected by the rollout stage (`token_count_problem`) before any bound sees it, and a
    non-finite weight makes `mean_policy_version` fall back to the oldest version.
    """
    value = trajectory.metrics.get("completion_tokens")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return float(value)
        if not math.isfinite(value) or value < 0:
            return math.nan
    return _missing_tokens(value)


def token_count_problem(index: int, trajectory: Any) -> str | None:
    """Why trajectory `index`'s token counts cannot weigh its group's policy age, else None.

    A `completion_tokens` metric (or a per-token version count) that is infinite, NaN or
    negative would turn the token-weighted mean age into NaN, or pull it outside the versions
    the tokens came from, and let an old group through `limit_mean_steps_off_policy`. Such a
    group is rejected as errored, as a NaN reward is (`batching.rollout_problem`). (A missing
    or zero count is one token, warned about once: ART 0.5.18 trajectories often have none.)
    """
    value = trajectory.metrics.get("completion_tokens")
    if _is_number(value) and (not math.isfinite(value) or value < 0):
        return (
            f"trajectory {index} has completion_tokens={value!r}: the token-weighted policy "
            "age cannot weigh it. Record a finite, non-negative count (the serving "
            "response's usage.completion_tokens), or leave the metric out"
        )
    counts = _attribute(trajectory, "_policy_token_counts") or {}
    for version, count in counts.items():
        if _is_number(count) and (not math.isfinite(count) or count < 0):
            return (
                f"trajectory {index} says {count!r} tokens came from policy version "
                f"{version} (_policy_token_counts): token counts must be finite and "
                "non-negative"
            )
    return None


def _missing_tokens(value: object) -> float:
    global _warned_missing_tokens
    if not _warned_missing_tokens:
        _warned_missing_tokens = True
        warnings.warn(
            "a trajectory has no positive `completion_tokens` metric (got "
            f"{value!r}); the token-weighted policy age counts it as one token. ART's "
            "trainer stops the run here; record it from the serving response's usage.",
            RuntimeWarning,
            stacklevel=3,
        )
    return 1.0


def version_tokens(trajectory: Trajectory) -> list[tuple[int, float]]:
    """Which policy versions produced a trajectory's tokens, and how many, as ART counts them.

    Per-token versions where the trajectory carries them (ART 0.5.20+'s `_policy_token_counts`,
    or `policy_token_spans` on its served choices: weights updated under a running rollout);
    otherwise its `initial_policy_version`, weighted by its `completion_tokens`, else by its
    served choices' token counts (one unit and a one-time warning where neither is known).
    Empty when no version is known.
    """
    counts = _attribute(trajectory, "_policy_token_counts")
    if counts:
        return [
            (int(v), float(n) if math.isfinite(n) else math.nan)
            for v, n in counts.items()
            if not n <= 0
        ]
    version = trajectory.initial_policy_version
    spans: list[tuple[int, float]] = []
    unattributed = 0.0
    for item in served_items(trajectory):
        if type(item) is dict and SPANS_KEY not in item:
            continue  # a message the user or the rollout wrote (the common case, kept cheap)
        found, missing = _choice_versions(item)
        spans += found
        unattributed += missing
    if spans:
        # Tokens no span accounts for (a choice served without spans, a malformed span) are
        # counted at the start version, the oldest any of the trajectory's tokens can be:
        # the bound is never judged on the fresher tokens alone.
        if unattributed and version is not None:
            spans.append((version, unattributed))
        return spans
    if version is None:
        return []
    metrics = trajectory.metrics
    if "completion_tokens" not in metrics:
        record_completion_tokens(trajectory)
        if "completion_tokens" not in metrics and 0 < unattributed < math.inf:
            # No span anywhere: `unattributed` is then the served choices' own token counts
            # (NaN if one has none), which ART 0.5.20+ records as `completion_tokens` and
            # older lines record nowhere.
            return [(version, unattributed)]
    return [(version, completion_weight(trajectory))]


def served_items(trajectory: Trajectory) -> Iterable[Any]:
    """Every message and choice of a trajectory, where ART looks for spans: its exchanges'
    served choices, its messages and choices, its additional histories'."""
    chats = getattr(_attribute(trajectory, "exchanges"), "chat_completions", None)
    histories = _attribute(trajectory, "additional_histories")
    if not chats and not histories:
        return trajectory.messages_and_choices
    return itertools.chain(
        (choice for exchange in chats or () for choice in exchange.response.choices),
        trajectory.messages_and_choices,
        *(history.messages_and_choices for history in histories or ()),
    )


def _choice_versions(item: Any) -> tuple[list[tuple[int, float]], float]:
    """A served item's `(version, tokens)` spans, and its tokens no span accounts for (NaN
    where that count is unknown). Messages written by the user or the rollout (dicts without
    spans) have neither: they are not trained."""
    extra = extra_fields(item)
    raw = extra.get(SPANS_KEY)
    if isinstance(item, Mapping) and raw is None:
        return [], 0.0
    found: list[tuple[int, float]] = []
    malformed = not isinstance(raw, list)
    for span in raw if isinstance(raw, list) else ():
        try:
            tokens = float(span["end_token"]) - float(span["start_token"])
            found.append((int(span["policy_version"]), tokens))
        except (KeyError, TypeError, ValueError, OverflowError):
            malformed = True  # a malformed span says nothing about the version
    # A non-finite span is kept (as NaN): the group's mean then falls back to its oldest
    # version rather than silently losing the span's tokens.
    spans = [(v, n if math.isfinite(n) else math.nan) for v, n in found if not n <= 0]
    total = _choice_tokens(item, extra)
    if total is None:
        return spans, math.nan if malformed else 0.0
    covered = sum(n for _, n in spans)
    return spans, max(0.0, total - covered) if math.isfinite(covered) else 0.0


def extra_fields(item: Any) -> Mapping[str, Any]:
    """Where a served item keeps `policy_token_spans` and `token_ids`: a dict message itself,
    a choice's fields beyond the model's own (pydantic's `model_extra`)."""
    return item if isinstance(item, Mapping) else getattr(item, "model_extra", None) or {}


def _choice_tokens(item: Any, extra: Mapping[str, Any]) -> float | None:
    """The completion tokens of a served choice, where it says (`token_ids`, or its logprobs)."""
    token_ids = extra.get("token_ids")
    if isinstance(token_ids, list):
        return float(len(token_ids))
    content = getattr(getattr(item, "logprobs", None), "content", None)
    return float(len(content)) if isinstance(content, list) else None


def mean_policy_version(group: Any) -> float | None:
    """The token-weighted mean policy version of a group's tokens (None if none is known).

    A group's token-weighted mean policy age at step s is `s - mean_policy_version(group)`:
    ART 0.5.20's `limit_mean_steps_off_policy` bounds that. If some token count is not a
    usable weight (NaN from `completion_weight`), the oldest version known stands for the
    group: the bound is then at its strictest, never weaker (such groups are rejected before
    this anyway, see `token_count_problem`).
    """
    total = weight = 0.0
    oldest: int | None = None
    usable = True
    for trajectory in group.trajectories:
        for version, tokens in version_tokens(trajectory):
            oldest = version if oldest is None else min(oldest, version)
            if not math.isfinite(tokens):
                usable = False
                continue
            total += version * tokens
            weight += tokens
    if not usable:
        return None if oldest is None else float(oldest)
    return total / weight if weight > 0 else None


def tokens_by_version(groups: Iterable[Any]) -> dict[int, float]:
    """The groups' tokens summed per policy version that produced them (`version_tokens`);
    counts that are not finite are left out."""
    tokens: dict[int, float] = {}
    for group in groups:
        for trajectory in group.trajectories:
            for version, count in version_tokens(trajectory):
                if math.isfinite(count):
                    tokens[version] = tokens.get(version, 0.0) + count
    return tokens


def plain_tokens(group: Any) -> dict[int, float] | None:
    """`tokens_by_version([group])` where every trajectory is plain, read in one quick pass;
    else None (`version_tokens` reads such a group, with its fallbacks and warning).

    Plain: an `art.Trajectory` with no per-token versions anywhere (no
    `_policy_token_counts`, no exchanges or additional histories, only dict messages without
    spans), an `initial_policy_version`, and a `completion_tokens` metric that is a positive
    finite int or float. `version_tokens` gives exactly `[(initial_policy_version,
    completion_tokens)]` for it. What a rollout usually returns: the stage reads it once as
    the group is handed over, so the trained step does not walk every trajectory again.
    """
    tokens: dict[int, float] = {}
    for trajectory in group.trajectories:
        if not isinstance(trajectory, Trajectory):
            return None
        private = trajectory.__pydantic_private__
        fields = trajectory.__dict__
        if (
            (private and private.get("_policy_token_counts"))
            or fields.get("exchanges")
            or fields.get("additional_histories")
        ):
            return None
        version = trajectory.initial_policy_version
        value: Any = trajectory.metrics.get("completion_tokens")
        if version is None or type(value) not in PLAIN_COUNTS or not 0 < value < math.inf:
            return None
        for item in trajectory.messages_and_choices:
            if type(item) is not dict or SPANS_KEY in item:
                return None
        tokens[version] = tokens.get(version, 0.0) + float(value)
    return tokens


def token_ages(tokens: Mapping[int, float], step: int) -> tuple[float, float]:
    """``(sum of token x policy age, tokens)`` of tokens counted per policy version
    (`tokens_by_version`), trained from policy ``step``."""
    return sum((step - v) * n for v, n in tokens.items()), sum(tokens.values())


def newest_token_version(group: Any) -> int | None:
    """The newest policy version any of a group's tokens (or trajectories) came from."""
    newest: int | None = None
    for trajectory in group.trajectories:
        versions = [v for v, _ in version_tokens(trajectory)]
        if trajectory.initial_policy_version is not None:
            versions.append(trajectory.initial_policy_version)
        for version in versions:
            if newest is None or version > newest:
                newest = version
    return newest
