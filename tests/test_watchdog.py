"""The stall watchdog (issue 37): each reported hang is named, stage and call.

ART's users report runs that stop moving without a word (OpenPipe/ART issues 315, 346, 395,
656). Each test here makes one such hang with real parts (a real `art.TrainableModel`, the
real trio-asyncio bridge, a real HTTP server on 127.0.0.1 and the real openai client) and
checks what the report says: the stage that waits, the call in flight, the rollouts in
flight, the line that waits. Virtual time (`autojump_clock`) wherever the hang is in async
code; the real clock where a thread or a socket is involved, with `stall_seconds` short.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio import PipelineTrainer, ScenarioSourceClosed, Stalled
from art_trio.plumbing.compat import trainable_model
from art_trio.resume.store import StateStore
from art_trio.watchdog import PipelineStalled, StallReport
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory

HERE = Path(__file__).name


class HangingTrain(RecordingBackend):
    """`backend.train` never returns from step `hang_at` on (ART issue 656: "hangs at
    training step 2"), until `hang` is switched off for a resumed run."""

    hang_at: int = 2
    hang: bool = True

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        if self.hang and self.step + 1 >= self.hang_at:
            await asyncio.Event().wait()  # the hang: nothing ever sets it


def _trainer(model: art.TrainableModel, backend: Any, rollout: Any, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "num_rollout_workers": 2,
        "min_batch_size": 2,
        "max_batch_size": 2,
        "eval_step_0": False,
        "log_interval_seconds": 1e9,
    }
    options.update(kwargs)
    source = options.pop("source", scenarios(8))
    return PipelineTrainer(model, backend, rollout, source, None, **options)


def _reports(trainer: Any) -> list[Stalled]:
    events: list[Stalled] = []
    trainer.add_observer(lambda e: events.append(e) if isinstance(e, Stalled) else None)
    return events


def _model(path: Path, backend: Any) -> art.TrainableModel:
    model = trainable_model(name="m", project="p", base_model="test-base", base_path=str(path))
    asyncio.run(model.register(backend))
    return model


@pytest.fixture
def hanging() -> HangingTrain:
    return HangingTrain()


@pytest.fixture
def hanging_model(tmp_path: Path, hanging: HangingTrain) -> art.TrainableModel:
    return _model(tmp_path, hanging)


# -- settings ---------------------------------------------------------------------------------


def test_the_reports_names_are_the_watchdogs_and_reachable_from_art_trio() -> None:
    import art_trio
    import art_trio.watchdog

    for name in ("PipelineStalled", "StallReport", "StageWait", "TaskFrame"):
        assert getattr(art_trio, name) is getattr(art_trio.watchdog, name)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "fast", True])
def test_bad_stall_seconds_are_refused_naming_the_setting(
    model: art.TrainableModel, backend: RecordingBackend, value: Any
) -> None:
    with pytest.raises(ValueError, match="stall_seconds must be 'auto', None"):
        _trainer(model, backend, asyncio_rollout, stall_seconds=value)


def test_bad_stall_action_is_refused(model: art.TrainableModel, backend: RecordingBackend) -> None:
    with pytest.raises(ValueError, match="stall_action must be one of 'log', 'raise', 'stop'"):
        _trainer(model, backend, asyncio_rollout, stall_action="panic")


def test_defaults(model: art.TrainableModel, backend: RecordingBackend) -> None:
    trainer = _trainer(model, backend, asyncio_rollout)
    assert trainer.settings.status.stall_seconds == "auto"
    assert trainer.stall_action == "log"


# -- a backend whose train never returns -------------------------------------------------------


async def test_a_hung_backend_train_is_named_with_its_step_and_line(
    hanging: HangingTrain,
    hanging_model: art.TrainableModel,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend, model = hanging, hanging_model
    trainer = _trainer(model, backend, asyncio_rollout, stall_seconds=120.0, source=scenarios(40))
    reports = _reports(trainer)
    at: list[float] = []

    def second_report_stops(event: Any) -> None:
        if isinstance(event, Stalled):
            at.append(trio.current_time())
            if event.report.repeat == 2:
                trainer.request_stop(force=True)

    trainer.add_observer(second_report_stops)
    started = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="art_trio"):
        await trainer.train(handle_signals=False)

    # Reported once at stall_seconds, again at twice that while it persisted.
    assert [r.report.repeat for r in reports] == [1, 2]
    first = reports[0].report
    assert 120.0 <= first.seconds and 120.0 <= at[0] - started <= 120.0 * 1.25 + 1
    assert 240.0 <= reports[1].seconds
    training = next(w for w in first.stages if w.stage == "training")
    assert training.waits_on == "backend.train (step 2)"
    assert training.since_s is not None and training.since_s >= 120.0
    assert [(c.stage, c.call) for c in first.calls] == [("training", "backend.train (step 2)")]
    assert first.rollouts == ()  # the bound holds the workers: nothing can train
    assert "waiting for a policy" in first.gate
    # The line that waits: the backend's own, in the asyncio task behind the bridge.
    hang_line = next(t for t in first.tasks if t.kind == "asyncio")
    assert HERE in hang_line.where and "before_train" in hang_line.where
    assert any(t.kind == "trio" and t.name == "art_trio training stage" for t in first.tasks)
    # Delivered four ways: the event (above), a metric, a log record, the status line.
    assert trainer.last_counters.stalls == 1
    assert trainer.statistics().stalls == 1
    assert any("art_trio stall report 1" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr().out
    assert "[stalled] the run has not moved" in out
    assert "STALLED 1 times" in out


async def test_raise_ends_the_run_with_the_report_and_a_retry_resumes_exactly_once(
    hanging: HangingTrain, hanging_model: art.TrainableModel, autojump_clock: trio.abc.Clock
) -> None:
    backend, model = hanging, hanging_model
    trainer = _trainer(model, backend, asyncio_rollout, stall_seconds=60.0, stall_action="raise")
    with pytest.raises(ExceptionGroup) as raised:
        await trainer.train(handle_signals=False)
    stalled = raised.value.subgroup(PipelineStalled)
    assert stalled is not None
    error = stalled.exceptions[0]
    assert isinstance(error, PipelineStalled) and isinstance(error.report, StallReport)
    assert "backend.train (step 2)" in str(error)
    assert "raised in art_trio's watchdog stage" in error.__notes__
    # The state is saved with the batch in the hung call pending.
    state = StateStore(model._get_output_dir()).read()
    assert state is not None and state.ledger.pending is not None
    assert len(backend.calls) == 1

    # The supervisor's retry: a new trainer, the backend answering again.
    backend.hang = False
    again = _trainer(model, backend, asyncio_rollout, stall_seconds=60.0, stall_action="raise")
    await again.train(handle_signals=False)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert sorted(trained) == list(range(8))  # each scenario trained exactly once


async def test_a_hung_scenario_source_is_not_mended_by_a_retry_and_the_message_says_what_is(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """What the message tells a supervisor is true: the same trainer's retry finds the hung
    generator closed (trio, no host loop), a new trainer with a new source trains the rest."""

    async def hangs_after_four() -> Any:
        for scenario in scenarios(4):
            yield scenario
        await asyncio.Event().wait()  # the source stops yielding, for good

    trainer = _trainer(
        model, backend, asyncio_rollout, source=hangs_after_four(), stall_seconds=60.0,
        stall_action="raise",
    )
    with pytest.raises(ExceptionGroup) as raised:
        await trainer.train(handle_signals=False)
    stalled = raised.value.subgroup(PipelineStalled)
    assert stalled is not None
    assert "give a new trainer a new source" in str(stalled.exceptions[0])
    with pytest.raises(ScenarioSourceClosed):
        await trainer.train(handle_signals=False)

    async def fresh() -> Any:
        for scenario in scenarios(8):
            yield scenario

    await _trainer(model, backend, asyncio_rollout, source=fresh()).train(handle_signals=False)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert sorted(trained) == list(range(8))  # each once: the new source skipped 0-3


# -- an eval that never ends -------------------------------------------------------------------


async def test_a_hung_eval_is_named_and_stop_ends_the_run_gracefully(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        if step == 2:
            await asyncio.Event().wait()  # the eval of step 2 never ends
        return [trajectory(1.0)]

    trainer = PipelineTrainer(
        model,
        backend,
        asyncio_rollout,
        scenarios(8),
        None,
        eval_fn,
        num_rollout_workers=2,
        min_batch_size=2,
        max_batch_size=2,
        eval_step_0=False,
        eval_every_n_steps=1,
        max_steps=2,
        log_interval_seconds=1e9,
        stall_seconds=90.0,
        stall_action="stop",
        shutdown_grace_seconds=5.0,
    )
    reports = _reports(trainer)
    await trainer.train(handle_signals=False)  # returns: the stop cancelled the eval

    assert len(reports) == 1
    report = reports[0].report
    waits = {w.stage: w.waits_on for w in report.stages}
    assert waits["eval"] == "eval_fn (step 2)"
    assert waits["training"].startswith("idle")
    assert ("eval", "eval_fn (step 2)") in [(c.stage, c.call) for c in report.calls]
    assert any("eval_fn" in t.where for t in report.tasks if t.kind == "asyncio")
    assert len(backend.calls) == 2


# -- a rollout that never ends, under anyio.run on asyncio -------------------------------------


def test_hung_rollouts_under_asyncio_name_their_scenarios(tmp_path: Path) -> None:
    backend = RecordingBackend()
    model = _model(tmp_path, backend)

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        if scenario["i"] >= 2:
            await asyncio.Event().wait()  # scenarios 2 and 3 never come back
        return await asyncio_rollout(model, scenario, config)

    trainer = _trainer(model, backend, rollout, stall_seconds=0.5, stall_action="raise")
    reports = _reports(trainer)

    async def main() -> None:
        await trainer.train(handle_signals=False)

    with pytest.raises(ExceptionGroup) as raised:
        anyio.run(main, backend="asyncio")
    assert raised.value.subgroup(PipelineStalled) is not None
    report = reports[0].report
    assert sorted(r.scenario_index for r in report.rollouts) == [2, 3]
    assert all(r.age_s >= 0.5 for r in report.rollouts)
    rollout_wait = next(w for w in report.stages if w.stage == "rollout")
    assert rollout_wait.waits_on.startswith("2 of 2 workers in rollouts")
    # asyncio.all_tasks: the rollouts' own line, no trio tasks.
    assert {t.kind for t in report.tasks} == {"asyncio"}
    assert sum(HERE in t.where and "rollout" in t.where for t in report.tasks) == 2


# -- an inference server that stops answering mid-gather ---------------------------------------

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@pytest.fixture
def server_going_silent() -> Iterator[tuple[str, threading.Event]]:
    """A real HTTP server on 127.0.0.1 answering its first 5 chat completions (a warm-up and
    four), then reading requests and never answering (until the test ends)."""
    silent = threading.Event()
    answered = [0]
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            with lock:
                answered[0] += 1
                answer = answered[0] <= 5
            if not answer:
                silent.wait(60)
                return
            body = json.dumps(COMPLETION).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", silent
    finally:
        silent.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_a_server_that_stops_answering_mid_gather_is_named(
    model: art.TrainableModel,
    backend: RecordingBackend,
    server_going_silent: tuple[str, threading.Event],
) -> None:
    import openai

    url, _ = server_going_silent
    # Warm-up: the client's first call imports and probes the platform (blocking the loop
    # for a second on a loaded machine, which the watchdog would rightly report).
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0) as warm:
        warm.chat.completions.create(model="m", messages=[{"role": "user", "content": "w"}])

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:

            async def one(k: int) -> art.Trajectory:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"q{k}"}]
                )
                return trajectory(float(k % 2))

            return art.TrajectoryGroup(await asyncio.gather(*(one(k) for k in range(3))))

    trainer = _trainer(
        model,
        backend,
        rollout,
        num_rollout_workers=1,
        min_batch_size=1,
        max_batch_size=1,
        stall_seconds=2.0,
        stall_action="stop",
        shutdown_grace_seconds=0.2,
    )
    reports = _reports(trainer)
    await trainer.train(handle_signals=False)  # the stop ends the hung rollout

    assert len(backend.calls) == 1, (trainer.last_counters, [r.report.text() for r in reports])
    report = next(r.report for r in reports if not r.report.blocked_loop)
    assert [r.scenario_index for r in report.rollouts] == [1]
    assert next(w for w in report.stages if w.stage == "rollout").waits_on.startswith(
        "1 of 1 workers in rollouts (oldest: scenario 1"
    )
    # Mid-gather: one of scenario 1's three requests was answered; two wait on the socket,
    # each in its own asyncio task, from the rollout's `create` call.
    waiting = [t for t in report.tasks if t.kind == "asyncio" and "in one" in t.awaited_from]
    assert len(waiting) == 2, report.text()
    assert all(HERE in t.awaited_from for t in waiting)
    assert all("httpcore" in t.where or "httpx" in t.where for t in waiting), report.text()


# -- a loop blocked by synchronous code ---------------------------------------------------------


class _ReleaseOnBlockedReport(logging.Handler):
    """Unblocks the loop once the watchdog's thread reported it blocked (a log record)."""

    def __init__(self, unblock: threading.Event) -> None:
        super().__init__()
        self.unblock = unblock  # (not `release`: a Handler's method of that name)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        # This test's own block (on a loaded machine an import can block the loop too).
        if "event loop has been blocked" in message and f"{HERE}" in message:
            self.unblock.set()


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_a_blocked_loop_is_reported_from_outside_with_the_blocking_frame(
    tmp_path: Path, loop: str
) -> None:
    backend = RecordingBackend()
    model = _model(tmp_path, backend)
    release = threading.Event()

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        if scenario["i"] == 0:
            release.wait(60)  # synchronous: blocks the event loop until the report
        return await asyncio_rollout(model, scenario, config)

    trainer = _trainer(
        model,
        backend,
        rollout,
        num_rollout_workers=1,
        min_batch_size=1,
        max_batch_size=1,
        max_steps=1,
        stall_seconds=0.5,
    )
    reports = _reports(trainer)
    handler = _ReleaseOnBlockedReport(release)
    logger = logging.getLogger("art_trio")
    logger.addHandler(handler)
    try:
        anyio.run(functools.partial(trainer.train, handle_signals=False), backend=loop)
    finally:
        logger.removeHandler(handler)

    assert release.is_set(), "the blocked loop was never reported"
    blocked = [r.report for r in reports if r.report.blocked_loop and HERE in r.report.text()]
    assert blocked, "the report reached the observers once the loop ran again"
    report = blocked[0]
    assert HERE in report.blocking_frame and "in rollout" in report.blocking_frame
    assert report.seconds >= 0.5
    assert [r.scenario_index for r in report.rollouts] == [0]
    assert "blocked for" in report.headline()
    assert len(backend.calls) == 1  # the run went on and finished


# -- which admission rule holds the workers (issue 51, item 6) --------------------------------


def _stall_report(spec: Any) -> StallReport:
    """The report a simulated run ends with (`stall_action="raise"`)."""
    from art_trio.sim.simulate import simulate

    with pytest.raises(BaseExceptionGroup) as raised:
        simulate(spec, time_limit_s=1e6)
    stalled = raised.value.subgroup(PipelineStalled)
    assert stalled is not None, raised.value
    error = stalled.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, PipelineStalled)
    return error.report


def test_workers_held_by_the_load_cap_are_reported_as_such() -> None:
    """A shared server (serving one rollout at full speed) that slows to a crawl after step 3,
    with the batch resized to 8 before: the rollouts in flight fill what the server can take
    inside the window, and the gate holds the other workers by the load cap, not by the
    staleness bound (the window has room: it wants 8 groups a batch)."""
    from art_trio.sim.inference import LatencyShift
    from art_trio.sim.simulate import SimSpec
    from art_trio.testing.distributions import parse_distribution

    spec = SimSpec(
        rollout_latency=parse_distribution("20"),
        train_time=parse_distribution("5"),
        steps=40,
        inference_capacity=1,
        seed=40,
        latency_shift=LatencyShift(3, 1000.0),
        trainer=dict(
            num_rollout_workers=16, min_batch_size=2, max_batch_size=2, max_steps_off_policy=1,
            stall_seconds=3000.0, stall_action="raise",
        ),
        resizes=((177.9, {"min_batch_size": 8, "max_batch_size": 8}),),
    )
    report = _stall_report(spec)
    assert "held by the load cap" in report.stages[0].waits_on
    assert "holds 9 workers: the load cap admits no rollout while 7 run" in report.gate
    assert "which can take 7 at once" in report.gate
    assert "staleness bound" not in report.gate and "waiting for a policy" not in report.gate


def test_a_stall_while_admission_is_unbounded_is_reported() -> None:
    """At max_steps_off_policy=0, before rollouts are seen to end together, the gate races
    every worker (no bound on the headroom). 31 racers sharing a server that serves one at
    full speed each take 620 s, past the stall floor of 600 s: the report says the gate
    admits any number, instead of ending the run on `int(inf)`."""
    from art_trio.sim.simulate import SimSpec
    from art_trio.testing.distributions import parse_distribution

    spec = SimSpec(
        rollout_latency=parse_distribution("20"),
        train_time=parse_distribution("1"),
        steps=30,
        inference_capacity=1,
        trainer=dict(
            num_rollout_workers=31, min_batch_size=2, max_batch_size=2, max_steps_off_policy=0,
            stall_action="raise",
        ),
    )
    report = _stall_report(spec)
    assert "admits any number of rollouts now" in report.gate
