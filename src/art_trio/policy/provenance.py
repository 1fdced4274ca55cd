"""Eval provenance: did the tokens an eval returns come from the policy of the step evaluated?

ART 0.5.20+'s servers annotate each generated completion with `policy_token_spans`: which
policy version produced which of its tokens. ART's trainer checks every eval against them
and drops an eval of step s holding tokens of another policy (an eval of step 1 served by
policy 0 measures policy 0, and logging it as step 1 would lie about step 1).

art_trio checks the same, with ART's rules and messages. Where the backend reports spans
(``compat.policy_spans_reported``: ART 0.5.20+ with a runtime that serves them) the check is
ART's, whole: an eval carrying no spans is refused too. Elsewhere an eval is checked wherever
its trajectories carry spans, and one carrying none at all (a server that does not annotate,
ART 0.5.17-0.5.18, a backend without serving capabilities) is logged as before, where ART
0.5.20+ would refuse it (docs/migrating-from-art.md, "Eval provenance"). ``describe_mode``
says which applies; the eval stage logs it when it starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import art
from openai.types.chat.chat_completion import Choice

from ..messages.errors import EvalProvenanceError
from ..plumbing.compat import POLICY_TOKEN_SPAN
from .freshness import SPANS_KEY, extra_fields, served_items


def describe_mode(strict: bool) -> str:
    """The line the eval stage logs at start: which provenance rule applies and why."""
    if POLICY_TOKEN_SPAN is None:
        return (
            "eval provenance: not checked (this ART line serves no policy_token_spans; "
            "0.5.20+ does)"
        )
    if strict:
        return (
            "eval provenance: the backend reports policy_token_spans, so evals are checked as "
            "ART's trainer checks them: an eval without spans, or with another step's tokens, "
            "is not logged"
        )
    return (
        "eval provenance: the backend does not report policy_token_spans: an eval carrying "
        "none is logged (ART 0.5.20+'s trainer refuses it), one carrying spans is checked"
    )


def check_eval_provenance(
    step: int, trajectories: Iterable[art.Trajectory], *, strict: bool = False
) -> None:
    """Raise EvalProvenanceError unless the eval of `step` is exactly `step`'s policy.

    With `strict` (the backend reports spans), always checked; otherwise only if some
    completion of the eval carries spans; never on ART lines without them. Then, as ART
    0.5.23 does: every generated choice must carry spans, every trajectory must have at
    least one completion with spans, each list of spans must be a contiguous partition of
    its completion from token 0, and every span's policy version must be `step`.
    """
    if POLICY_TOKEN_SPAN is None:
        return
    trajectories = list(trajectories)
    if not strict and not any(
        extra_fields(item).get(SPANS_KEY) is not None
        for trajectory in trajectories for item in served_items(trajectory)
    ):
        return
    for trajectory in trajectories:
        found = False
        for item in served_items(trajectory):
            spans = _validated_spans(item, required=isinstance(item, Choice))
            if spans is None:
                continue
            found = True
            for span in spans:
                if span.policy_version != step:
                    raise EvalProvenanceError(
                        f"Eval at step {step} returned policy-{span.policy_version} tokens"
                    )
        if not found:
            raise EvalProvenanceError("Exact policy provenance is missing policy_token_spans")


def _validated_spans(item: Any, *, required: bool) -> list[Any] | None:
    raw = extra_fields(item).get(SPANS_KEY)
    if raw is None:
        if required:
            raise EvalProvenanceError("Exact policy provenance is missing policy_token_spans")
        return None
    if not isinstance(raw, list) or not raw:
        raise EvalProvenanceError("policy_token_spans must be a non-empty list")
    assert POLICY_TOKEN_SPAN is not None
    spans = [POLICY_TOKEN_SPAN.model_validate(span) for span in raw]
    cursor = 0
    for span in spans:
        if span.start_token != cursor:
            raise EvalProvenanceError(
                "policy_token_spans must be a contiguous completion partition"
            )
        cursor = span.end_token
    return spans
