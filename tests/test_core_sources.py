"""Behaviour 1, 9, 10: where scenarios come from, how a run ends, what is persisted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from art_trio import PipelineTrainer
from tests.doubles import asyncio_rollout, scenarios


def pipeline_state(model: Any) -> dict[str, Any]:
    state = json.loads((Path(model._get_output_dir()) / "state.json").read_text())
    return state["_pipeline_trainer"]


async def test_sync_iterable_source_trains_every_scenario_and_counts_them(model, backend):
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(10), None,
        num_rollout_workers=3, min_batch_size=2, max_batch_size=2,
    )
    await trainer.train(handle_signals=False)
    assert sorted(backend.trained_ids) == list(range(10))
    state = pipeline_state(model)
    assert state["scenario_offset"] == 10
    assert state["total_scenarios_consumed"] == 10
    assert state["training_step"] == backend.step == 5


async def test_async_iterator_source_is_pulled_as_asyncio_code(model, backend):
    async def source() -> AsyncIterator[dict[str, Any]]:
        for scenario in scenarios(6):
            await asyncio.sleep(0)  # asyncio-only: fails if pulled from plain trio
            yield scenario

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, source(), None,
        num_rollout_workers=2, min_batch_size=3, max_batch_size=3,
    )
    await trainer.train(handle_signals=False)
    assert sorted(backend.trained_ids) == list(range(6))
    assert pipeline_state(model)["total_scenarios_consumed"] == 6


async def test_finite_source_trains_a_final_partial_batch(model, backend):
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(5), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    await trainer.train(handle_signals=False)
    assert [len(c.scenario_ids) for c in backend.calls] == [2, 2, 1]


async def test_max_steps_counts_steps_of_this_run(model, backend):
    def make() -> PipelineTrainer:
        return PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(100), None,
            num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps=2,
        )

    await make().train(handle_signals=False)
    assert backend.step == 2
    await make().train(handle_signals=False)
    assert backend.step == 4
    # Resumed: the second run trained scenarios the first had not.
    ids = backend.trained_ids
    assert len(ids) == len(set(ids)) == 8


async def test_max_steps_zero_trains_nothing(model, backend):
    trainer = PipelineTrainer(model, backend, asyncio_rollout, scenarios(10), None, max_steps=0)
    await trainer.train(handle_signals=False)
    assert backend.calls == []


async def test_resume_skips_resolved_scenarios_and_warns_when_the_source_is_short(
    model, backend, caplog
):
    first = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(8), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    await first.train(handle_signals=False)
    assert pipeline_state(model)["scenario_offset"] == 8
    second = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(5), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    await second.train(handle_signals=False)
    out = caplog.text
    assert "scenario iterator exhausted early while skipping (skipped 5/8)" in out
    assert backend.step == 4  # nothing new trained


async def test_resume_false_starts_from_the_first_scenario(model, backend):
    for _ in range(2):
        await PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(4), None,
            num_rollout_workers=1, min_batch_size=2, max_batch_size=2, resume=False,
        ).train(handle_signals=False)
    assert sorted(backend.trained_ids) == [0, 0, 1, 1, 2, 2, 3, 3]


async def test_state_keeps_the_references_four_fields(model, backend):
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2, eval_every_n_steps=0,
    ).train(handle_signals=False)
    state = pipeline_state(model)
    reference_fields = {"scenario_offset", "total_scenarios_consumed", "training_step"}
    assert reference_fields | {"last_eval_step"} <= set(state)


async def test_art_train_step_log_prints_start_and_end(model, backend, monkeypatch, capsys):
    monkeypatch.setenv("ART_TRAIN_STEP_LOG", "1")
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(2), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    out = capsys.readouterr().out
    assert "[train] step 1 starting (batch=2)" in out
    assert "[train] step 1 done in" in out


async def test_a_clean_end_leaves_no_pending_batch_or_stray_resolutions(model, backend):
    """Extra art_trio fields ride along without disturbing the reference's."""
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(3), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    state = pipeline_state(model)
    assert state["pending_batch"] is None
    assert state["resolved_scenarios"] == []


async def test_a_one_shot_source_remembers_what_it_skipped_when_a_stop_cut_its_pull() -> None:
    """The cursor's position counts the resolved scenarios a take skipped, not only those it
    handed out: a stop that cancels the pull after a skip must not make the next `train()`
    number the iterator's next scenario as the skipped one (and skip it as resolved)."""
    import trio

    from art_trio.plumbing.bridge.calls import open_bridge
    from art_trio.plumbing.progress import RunProgress
    from art_trio.plumbing.source import ScenarioCursor, ScenarioSource
    from art_trio.resume.scenarios import ScenarioLedger

    async def source() -> AsyncIterator[str]:  # asyncio code, as a user's
        yield "a"
        yield "b"  # index 1: resolved in the state, skipped
        await asyncio.Event().wait()  # the pull a stop cancels
        yield "c"

    cursor = ScenarioCursor(source())
    state = RunProgress(ledger=ScenarioLedger(resolved_above={1}))
    async with open_bridge() as bridge:
        taking = ScenarioSource(cursor, state, bridge)
        assert await taking.take() == (0, "a")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(taking.take)
            await trio.testing.wait_all_tasks_blocked()
            taking.close()
    assert cursor.read == 2  # "a" and the skipped "b": the iterator stands at index 2


def test_a_stop_landing_as_a_pull_completes_keeps_its_scenario_for_the_next_call() -> None:
    """The stop's cancellation reaches the taker in the step that completes its pull: the
    scenario pulled is the next take's (the next `train()` call's), neither dropped nor its
    index given to the scenario after it."""
    import anyio

    from art_trio.plumbing.bridge.calls import open_bridge
    from art_trio.plumbing.progress import RunProgress
    from art_trio.plumbing.source import ScenarioCursor, ScenarioSource
    from art_trio.resume.scenarios import ScenarioLedger

    async def main() -> None:
        taker: asyncio.Future[Any] | None = None

        async def source() -> AsyncIterator[int]:
            for i in range(4):
                if i == 2:
                    assert taker is not None
                    taker.cancel()  # as the stop does, while this pull completes
                yield i

        cursor = ScenarioCursor(source())
        state = RunProgress(ledger=ScenarioLedger())
        async with open_bridge() as bridge:
            first = ScenarioSource(cursor, state, bridge)
            assert [await first.take(), await first.take()] == [(0, 0), (1, 1)]
            taker = asyncio.ensure_future(first.take())
            try:
                await taker
            except asyncio.CancelledError:
                pass
            assert cursor.pull is not None and cursor.pull.done()
            again = ScenarioSource(cursor, state, bridge)  # the next train() call's
            # What the first call took and did not resolve first, then the pulled one.
            taken = [await again.take() for _ in range(5)]
            assert taken == [(0, 0), (1, 1), (2, 2), (3, 3), None]

    anyio.run(main, backend="asyncio")


def test_a_generator_closed_after_a_pull_completed_is_refused_not_taken_for_its_end() -> None:
    """Under trio with no loop of the host's, a pull can complete as the stop comes, and then
    the call's closing loop finalizes the generator: the next call must refuse it, not hand
    out the one pulled scenario and take the closed generator for the source's end."""
    import anyio
    import pytest

    from art_trio import ScenarioSourceClosed
    from art_trio.plumbing.source import ScenarioCursor
    from art_trio.resume.scenarios import ScenarioLedger

    async def main() -> None:
        async def source() -> AsyncIterator[int]:
            for i in range(4):
                yield i

        generator = source()

        async def pull() -> int:
            return await generator.__anext__()

        cursor = ScenarioCursor(generator)
        cursor.pull = asyncio.ensure_future(pull())
        await cursor.pull
        await generator.aclose()  # as the closing loop finalizes it
        with pytest.raises(ScenarioSourceClosed, match="closed after 0 scenarios"):
            cursor.start(ScenarioLedger())

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_a_plain_iterator_raising_asyncio_cancelled_error_fails_the_run_naming_it(
    model: Any, backend: Any, loop: str
) -> None:
    """A plain iterator's `next` cannot be cancelled by the trainer: its CancelledError is
    its own, and under asyncio it ended the run as if cancelled, silently."""
    import functools

    import anyio

    from art_trio import AsyncioTaskCancelled

    def source() -> Any:
        yield from scenarios(4)
        raise asyncio.CancelledError("the queue client gave up")

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, source(), None, min_batch_size=2, max_batch_size=2
    )
    with pytest.RaisesGroup(
        pytest.RaisesExc(AsyncioTaskCancelled, match=r"source raised asyncio.CancelledError"),
        flatten_subgroups=True,
    ):
        anyio.run(functools.partial(trainer.train, handle_signals=False), backend=loop)
