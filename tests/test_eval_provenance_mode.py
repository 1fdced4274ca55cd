"""Eval provenance as ART 0.5.23 has it (issue 35): where the backend reports
`policy_token_spans`, an eval without them is refused as ART's trainer refuses it; where it
does not, such an eval is logged (a documented difference); the eval stage says which at start.
"""

from __future__ import annotations

import logging
from typing import Any

import art
import pytest

from art_trio.plumbing.compat import ART_0520, policy_spans_reported
from tests.doubles import RecordingBackend, trajectory
from tests.test_art_trainer_tests import (
    LOOPS,
    ONLY_0520,
    history,
    run,
    served_choice,
    trainer_for,
    two_rewards,
)


def reports_spans(model: art.TrainableModel) -> None:
    """What ART 0.5.23's LocalBackend does at registration when its vLLM runtime serves
    spans: the model learns the runtime's capabilities."""
    capabilities = pytest.importorskip("art.serving_capabilities").ServingCapabilities
    object.__setattr__(
        model,
        "_serving_capabilities",
        capabilities(runtime="art_vllm", protocol_version=5, policy_token_spans=True),
    )


async def spans_at_step_0_only(model: Any, step: int, config: Any) -> list[art.Trajectory]:
    if step == 0:
        return [
            art.Trajectory(
                reward=0.5,
                messages_and_choices=[{"role": "user", "content": "q"}, served_choice(0)],
            )
        ]
    return [trajectory(0.25)]  # no completion, no spans


@ONLY_0520
@LOOPS
def test_with_a_backend_that_reports_spans_an_eval_without_them_is_refused(
    model: art.TrainableModel,
    backend: RecordingBackend,
    loop: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ART 0.5.23's test_eval_requires_at_least_one_generated_choice, where the runtime
    reports spans: step 0's eval (spans of policy 0) is logged, step 1's (none) is not."""
    reports_spans(model)
    assert policy_spans_reported(model)
    with caplog.at_level(logging.INFO, "art_trio"):
        run(
            trainer_for(
                model, backend, two_rewards, [0], spans_at_step_0_only, eval_every_n_steps=1
            ),
            loop,
        )
    assert [r["step"] for r in history(model) if "val/reward" in r] == [0]
    messages = [r.getMessage() for r in caplog.records]
    assert any("backend reports policy_token_spans" in m for m in messages)
    assert any("missing policy_token_spans" in m for m in messages)


@LOOPS
def test_without_reported_spans_such_an_eval_is_logged_and_the_start_says_so(
    model: art.TrainableModel,
    backend: RecordingBackend,
    loop: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The documented difference, kept where the backend cannot report spans (the double
    has no serving capabilities; ART 0.5.18 has no spans at all)."""
    assert not policy_spans_reported(model)
    with caplog.at_level(logging.INFO, "art_trio"):
        run(
            trainer_for(
                model, backend, two_rewards, [0], spans_at_step_0_only, eval_every_n_steps=1
            ),
            loop,
        )
    assert [r["step"] for r in history(model) if "val/reward" in r] == [0, 1]
    expected = "does not report policy_token_spans" if ART_0520 else "not checked"
    assert any(expected in r.getMessage() for r in caplog.records)
