"""The trainer with in-flight updates: rollouts whose tokens span several policies.

A backend that updates weights under running rollouts (``in_flight_updates``) reports which
policy produced which tokens (``policy_token_spans``). The gate then lets a rollout run past
the mean bound's start-version window while its token mix can still meet the bound, and the
finished group is judged on its exact spans; the hard bound stays on the start version.
"""

from __future__ import annotations

import warnings
from typing import Any

import art
import pytest
import trio
from openai.types.chat.chat_completion import Choice

from art_trio import PipelineTrainer, trio_native
from art_trio.admission import MeasuringGate, StalenessAwareAdmission
from art_trio.policy.batching import Freshness
from art_trio.policy.freshness import mean_policy_version, version_tokens
from art_trio.testing.doubles import TrainBatch
from tests.doubles import RecordingBackend, scenarios


def mixed_trajectory(reward: float, runs: list[tuple[int, int]]) -> art.Trajectory:
    """A one-turn trajectory whose completion tokens came from ``runs`` of (version, tokens)."""
    spans, start = [], 0
    for version, tokens in runs:
        spans.append(
            {
                "start_token": start,
                "end_token": start + tokens,
                "generation_id": f"m@{version}",
                "policy_version": version,
                "lora_slot": "m:active",
                "update_seq": version,
            }
        )
        start += tokens
    choice = Choice.model_validate(
        {
            "finish_reason": "stop",
            "index": 0,
            "message": {"role": "assistant", "content": "a"},
            "policy_token_spans": spans,
        }
    )
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, choice],
        reward=reward,
        metrics={"completion_tokens": start},
    )


def in_flight_rollout(backend: RecordingBackend, slow: set[int]) -> Any:
    """Scenarios in `slow` take 2.5 s, the others 1 s; each decodes half its 10 tokens under
    the policy it started with and half under the newest one when it ends, as a server with
    in-flight updates would report them."""

    @trio_native
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        start = backend.step
        await trio.sleep(2.5 if scenario["i"] in slow else 1.0)
        runs = [(start, 5), (backend.step, 5)]
        return art.TrajectoryGroup([mixed_trajectory(float(k), runs) for k in range(2)])

    return rollout


@pytest.mark.parametrize("in_flight", [False, True], ids=["cancelled", "in-flight"])
async def test_a_rollout_past_the_start_version_window_is_trained_when_its_mix_is_fresh(
    model: Any, backend: RecordingBackend, autojump_clock: Any, in_flight: bool
) -> None:
    """Mean bound 1, batches of one, two workers: scenario 1 starts at version 0 and ends
    after step 2 began. Without in-flight updates the gate cancels it when step 2 begins
    (its tokens would all be version 0: age 2). With them it goes on, ends with half its
    tokens from version 2 (mean age 1 for the batch from step 2) and is trained."""
    backend.in_flight_updates = in_flight  # type: ignore[attr-defined]
    batches: list[TrainBatch] = []
    record = backend.record

    def keep(batch: TrainBatch) -> None:
        batches.append(batch)
        record(batch)

    backend.record = keep  # type: ignore[method-assign]
    trainer = PipelineTrainer(
        model, backend, in_flight_rollout(backend, slow={1}), scenarios(6), None,
        num_rollout_workers=2, min_batch_size=1, max_batch_size=1,
        max_steps_off_policy=None, limit_mean_steps_off_policy=1.0, max_steps=4,
    )
    await trainer.train(handle_signals=False)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    counters = trainer.last_counters
    assert counters is not None
    if in_flight:
        assert 1 in trained and counters.stale_cancelled == 0, (trained, counters)
    else:
        assert 1 not in trained and counters.stale_cancelled == 1, (trained, counters)
    # Each trained token aged by the policy that produced it; no group past the mean bound.
    ages = []
    for batch in batches:
        for group in batch.groups:
            tokens = [
                (batch.step - 1 - span["policy_version"], span["end_token"] - span["start_token"])
                for t in group.trajectories
                for span in t.messages_and_choices[-1].model_extra["policy_token_spans"]
            ]
            assert sum(a * n for a, n in tokens) / sum(n for _, n in tokens) <= 1.0
            ages.extend(tokens)
    statistics = trainer.statistics()
    assert statistics.token_policy_age == pytest.approx(
        sum(a * n for a, n in ages) / sum(n for _, n in ages)
    )


def test_the_cancel_window_widens_only_for_the_mean_bound_with_in_flight_updates() -> None:
    assert Freshness(1).cancel_window(True) == 1  # the hard bound: the start version decides
    assert Freshness(None, 1.5).cancel_window(False) == 1
    assert Freshness(None, 1.5).cancel_window(True) == 3
    assert Freshness(2, 1.5).cancel_window(True) == 2
    assert Freshness(None, 0.0).cancel_window(True) == 0


def test_admission_counts_rollouts_running_on_past_the_start_version_window() -> None:
    """With in-flight updates a rollout runs on past its start version's window (it is not
    cancelled while its mix can still meet the mean bound), and batches take the oldest ready
    groups first: it comes before any rollout started now, so admission counts it as one of
    the fresh rollouts in flight. Without in-flight updates it would have been cancelled."""
    gate = MeasuringGate(
        start_step=0, max_steps_off_policy=1, max_batch_size=2,
        policy=StalenessAwareAdmission(beyond_bound=0), clock=lambda: 0.0,
        cancel_window=Freshness(None, 1.0).cancel_window(True),
    )
    running = [trio.run(gate.admit) for _ in range(2)]
    assert running == [0, 0]
    gate.note_rollout_time(5.0, completed=True)  # rollouts outlast training (instant here)
    gate.begin_training(1, batch_size=0)
    gate.publish(1)
    gate.begin_training(2, batch_size=0)  # training step 2: a version-0 rollout can still be
    snap = gate.snapshot()  # trained by the batch of step 3 if most of its tokens are newer
    assert snap.fresh_in_flight == 2
    assert gate.policy.headroom(snap) == 0  # the batch of step 3 has two slots, both spoken for
    gate.rollout_done(running[0])
    assert gate.policy.headroom(gate.snapshot()) == 1


@pytest.mark.parametrize(
    ("rollout_s", "cancelled"),
    [(3.0, True), (25.0, False), (None, True)],
    ids=["short", "long", "unmeasured"],
)
def test_the_wider_cancel_window_holds_only_where_rollouts_outlast_training(
    rollout_s: float | None, cancelled: bool
) -> None:
    """Mean bound 0.5 with in-flight updates: a rollout still running when its version's
    batch is taken can be trained only with tokens decoded after the coming publish. Where
    rollouts take 3 s and a training call 10 s it ends long before that (all its tokens one
    step old): the gate cancels it at once, as without in-flight updates, and does not count
    it as fresh. Where they take 25 s, it goes on under the next policy. Before any rollout
    has completed, the start version's window holds."""
    now = [0.0]
    gate = MeasuringGate(
        start_step=0, max_steps_off_policy=Freshness(None, 0.5).window, max_batch_size=1,
        policy=StalenessAwareAdmission(beyond_bound=0), clock=lambda: now[0],
        cancel_window=Freshness(None, 0.5).cancel_window(True),
    )
    if rollout_s is not None:
        for _ in range(32):
            gate.note_rollout_time(rollout_s, completed=True)
    gate.begin_training(1, batch_size=0)
    now[0] = 10.0
    gate.publish(1)

    async def race() -> None:
        version = await gate.admit()
        scope = trio.CancelScope()
        gate.track(version, scope)  # type: ignore[arg-type]
        gate.begin_training(2, batch_size=0)  # the batch its rollout raced for is taken
        assert scope.cancel_called is cancelled
        assert gate.snapshot().fresh_in_flight == (0 if cancelled else 1)

    trio.run(race)


def _choice(tokens: int, spans: Any = None) -> Choice:
    body: dict[str, Any] = {
        "finish_reason": "stop",
        "index": 0,
        "message": {"role": "assistant", "content": "a"},
        "token_ids": list(range(tokens)),
    }
    if spans is not None:
        body["policy_token_spans"] = spans
    return Choice.model_validate(body)


def _span(version: int, start: int, end: int) -> dict[str, Any]:
    return {"start_token": start, "end_token": end, "policy_version": version}


def _served(start_version: int, *choices: Choice) -> art.Trajectory:
    items: list[Any] = []
    for choice in choices:
        items += [{"role": "user", "content": "q"}, choice]
    trajectory = art.Trajectory(messages_and_choices=items, reward=1.0)
    trajectory.initial_policy_version = start_version
    return trajectory


def test_tokens_no_span_accounts_for_count_at_the_start_version() -> None:
    """A turn served without spans, or a malformed span, must not leave the mean age judged on
    the fresher tokens alone: those tokens count at the start version, the oldest they can be."""
    fresh_turn = _choice(10, [_span(5, 0, 10)])
    # First turn without spans (10 tokens), second all step 5: mean version 4, not 5.
    mixed = _served(3, _choice(10), fresh_turn)
    assert sorted(version_tokens(mixed)) == [(3, 10.0), (5, 10.0)]
    assert mean_policy_version(art.TrajectoryGroup([mixed])) == 4.0
    # A malformed span over the first 6 tokens: those 6 count at the start version.
    malformed = _served(3, _choice(10, [{"start_token": 0, "policy_version": 5}, _span(5, 6, 10)]))
    assert sorted(version_tokens(malformed)) == [(3, 6.0), (5, 4.0)]
    # Spans that cover every token are taken as they are.
    assert version_tokens(_served(3, fresh_turn)) == [(5, 10.0)]
    # A backend that reports no spans at all: the start version, as before.
    plain = _served(3, _choice(10))
    plain.metrics["completion_tokens"] = 10
    assert version_tokens(plain) == [(3, 10.0)]
    # Without the metric (ART 0.5.17-0.5.18 records none), the served choices' own counts.
    assert version_tokens(_served(3, _choice(10), _choice(4))) == [(3, 14.0)]
    # One choice that does not say: no partial count; one unit (and the one-time warning).
    uncounted = _choice(0)
    del uncounted.model_extra["token_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert version_tokens(_served(3, _choice(10), uncounted)) == [(3, 1.0)]


def test_per_token_counts_and_served_exchanges_weigh_the_versions() -> None:
    """ART 0.5.20+ can carry the per-version counts on the trajectory itself
    (`_policy_token_counts`, a private attribute) and the served turns in `exchanges`; both
    are read, so a mixed trajectory is never aged by its start version alone."""
    trajectory = _served(3, _choice(10))
    if "_policy_token_counts" not in type(trajectory).__private_attributes__:
        pytest.skip("this ART's Trajectory has no _policy_token_counts (0.5.17-0.5.18)")
    trajectory._policy_token_counts = {3: 4, 5: 6}
    assert sorted(version_tokens(trajectory)) == [(3, 4.0), (5, 6.0)]
    assert mean_policy_version(art.TrajectoryGroup([trajectory, trajectory])) == 4.2

    from art.trajectories import ChatCompletionsExchange, TrajectoryExchanges
    from openai.types.chat import ChatCompletion

    response = ChatCompletion(
        id="c",
        object="chat.completion",
        created=0,
        model="m",
        choices=[_choice(7, [_span(5, 0, 7)])],
    )
    exchange = ChatCompletionsExchange(
        start_time=trajectory.start_time,
        end_time=trajectory.start_time,
        request={"model": "m", "messages": []},
        response=response,
    )
    served = art.Trajectory(
        exchanges=TrajectoryExchanges(chat_completions=[exchange]), initial_policy_version=3
    )
    assert version_tokens(served) == [(5, 7.0)]
