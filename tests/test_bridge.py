"""The bridge: ART's asyncio world reached from trio through trio-asyncio (issue 3)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import traceback
from pathlib import Path
from typing import Any

import anyio
import art
import hypercorn.config
import hypercorn.trio
import openai
import pytest
import sniffio
import trio
import trio_asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_trio import PipelineTrainer, trio_native
from art_trio.plumbing.compat import trainable_model
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory

SRC = Path(__file__).resolve().parents[1] / "src" / "art_trio"


def small_trainer(model: Any, backend: Any, rollout: Any = asyncio_rollout, **kw: Any) -> Any:
    settings: dict[str, Any] = dict(
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps=2,
        log_interval_seconds=3600,
    )
    settings.update(kw)
    return PipelineTrainer(model, backend, rollout, scenarios(20), None, **settings)


def assert_logged_two_steps(model: Any) -> None:
    out = Path(model._get_output_dir())
    assert sorted(p.name for p in (out / "trajectories" / "train").iterdir()) == [
        "0001.parquet",
        "0002.parquet",
    ]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in history if "train/reward" in r) == [1, 2]


@pytest.mark.parametrize(
    "how",
    ["trio.run", "anyio.run(asyncio)", "anyio.run(trio)"],
)
def test_the_same_run_three_ways(model: Any, backend: RecordingBackend, how: str) -> None:
    trainer = small_trainer(model, backend)
    train = functools.partial(trainer.train, handle_signals=False)
    if how == "trio.run":
        trio.run(train)
    elif how == "anyio.run(asyncio)":
        anyio.run(train, backend="asyncio")
    else:
        anyio.run(train, backend="trio")
    assert backend.step == 2
    assert_logged_two_steps(model)


def test_the_backend_double_really_is_asyncio_only(backend: RecordingBackend) -> None:
    async def call_from_plain_trio() -> None:
        await backend._get_step(None)

    with pytest.raises(RuntimeError, match="no running event loop"):
        trio.run(call_from_plain_trio)


def test_only_the_bridge_module_knows_trio_asyncio() -> None:
    users = sorted(
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if re.search(r"^\s*(import|from) trio_asyncio\b", path.read_text(), re.MULTILINE)
    )
    # The bridge package: the calls themselves, and the tuning of the loop it opens.
    assert users == ["plumbing/bridge/calls.py", "plumbing/bridge/loop.py"]


# -- a real OpenAI client against a real HTTP server on 127.0.0.1 -----------------------------


async def chat_completions(request: Request) -> JSONResponse:
    body = await request.json()
    n = int(body.get("n", 1))
    return JSONResponse(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": ["maybe", "no"][i % 2]},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
                for i in range(n)
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": 1 + n},
        }
    )


APP = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])


async def test_an_openai_client_rollout_under_trio(model: Any, backend: RecordingBackend) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    shutdown = trio.Event()
    seen_libraries: set[str] = set()

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        # Plain asyncio code, as an ART user writes it.
        seen_libraries.add(sniffio.current_async_library())
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        messages: Any = [{"role": "user", "content": "yes, no or maybe?"}]
        response = await client.chat.completions.create(
            model="m@0", messages=messages, n=2
        )
        await client.close()
        return art.TrajectoryGroup(
            art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward={"maybe": 1.0, "no": 0.75}[choice.message.content or ""],
            )
            for choice in response.choices
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(hypercorn.trio.serve, APP, config, shutdown_trigger=shutdown.wait)
        )
        # The server's choices carry no token counts, and the rollout records none: said once.
        with pytest.warns(RuntimeWarning, match="no positive `completion_tokens` metric"):
            await small_trainer(model, backend, rollout).train(handle_signals=False)
        shutdown.set()
    assert seen_libraries == {"asyncio"}
    assert backend.calls[0].rewards == [[1.0, 0.75], [1.0, 0.75]]
    assert_logged_two_steps(model)


# -- cancellation across the bridge ---------------------------------------------------------


async def test_a_stop_with_no_grace_cancels_an_asyncio_rollout_and_its_finally_runs(
    model: Any, backend: RecordingBackend
) -> None:
    started = trio.Event()
    finally_ran = 0

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        nonlocal finally_ran
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            finally_ran += 1
        raise AssertionError("unreachable")

    trainer = small_trainer(model, backend, rollout, shutdown_grace_seconds=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(trainer.train, handle_signals=False))
        await started.wait()
        stop_at = trio.current_time()
        trainer.request_stop()
    assert trio.current_time() - stop_at < 1.0
    assert finally_ran == 2
    assert trainer.last_counters.dropped_at_stop == 2


async def test_asyncio_code_cancelling_itself_is_an_errored_rollout_not_a_crash(
    model: Any, backend: RecordingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] == 0:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        return await asyncio_rollout(model, scenario, config)

    trainer = small_trainer(model, backend, rollout, num_rollout_workers=1)
    await trainer.train(handle_signals=False)
    assert trainer.last_counters.errored == 1
    assert "AsyncioTaskCancelled" in caplog.text
    assert backend.step == 2


async def test_exceptions_cross_with_their_type_and_traceback(model: Any) -> None:
    class BackendBroke(Exception):
        pass

    class Exploding(RecordingBackend):
        async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
            asyncio.get_running_loop()
            raise BackendBroke("out of GPU memory")

    backend = Exploding()
    object.__setattr__(model, "_backend", backend)
    with pytest.RaisesGroup(pytest.RaisesExc(BackendBroke, match="out of GPU memory")) as info:
        await small_trainer(model, backend).train(handle_signals=False)
    error = info.value.exceptions[0]
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "train" in frames  # the backend's own frame is in the traceback
    assert "raised in art_trio's training stage" in getattr(error, "__notes__", [])


# -- trio programs: their own loop, nursery.start, several trainers, native callbacks -------


async def test_a_host_trio_asyncio_loop_is_reused(model: Any, backend: RecordingBackend) -> None:
    loops: set[int] = set()

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        loops.add(id(asyncio.get_running_loop()))
        return await asyncio_rollout(model, scenario, config)

    async with trio_asyncio.open_loop() as host_loop:
        await small_trainer(model, backend, rollout).train(handle_signals=False)
        assert trio_asyncio.current_loop.get() is host_loop
    assert loops == {id(host_loop)}


async def test_without_a_host_loop_train_opens_and_closes_its_own(
    model: Any, backend: RecordingBackend
) -> None:
    loops: list[Any] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        loops.append(asyncio.get_running_loop())
        return await asyncio_rollout(model, scenario, config)

    assert trio_asyncio.current_loop.get() is None
    await small_trainer(model, backend, rollout).train(handle_signals=False)
    assert loops and all(loop.is_closed() for loop in loops)


async def test_a_native_trio_rollout_runs_without_the_bridge(
    model: Any, backend: RecordingBackend
) -> None:
    libraries: set[str] = set()

    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        # Through the bridge this would be an asyncio task, and sniffio would say so.
        libraries.add(sniffio.current_async_library())
        await trio.sleep(0.001)
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    trainer = small_trainer(model, backend, rollout)
    await trainer.train(handle_signals=False)
    assert libraries == {"trio"}
    assert backend.step == 2, trainer.last_counters


async def test_nursery_start_reports_started_once_stages_run(
    model: Any, backend: RecordingBackend
) -> None:
    trainer = small_trainer(model, backend, max_steps=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        # Started means running: the trainer is live and accepts a stop.
        assert trainer._session is not None and trainer._session.run is not None
        trainer.request_stop()
    assert trainer._session is None


async def test_two_trainers_side_by_side_are_independent(tmp_path: Path) -> None:
    trainers = []
    backends = []
    for name in ("a", "b"):
        backend = RecordingBackend()
        model = trainable_model(
            name=name, project="p", base_model="x", base_path=str(tmp_path / ".art")
        )
        await trio_asyncio.aio_as_trio(model.register)(backend) if False else None
        object.__setattr__(model, "_backend", backend)
        backends.append(backend)
        trainers.append(
            PipelineTrainer(
                model, backend, asyncio_rollout, scenarios(8 if name == "a" else 4), None,
                num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
                log_interval_seconds=3600,
            )
        )
    async with trio.open_nursery() as nursery:
        for trainer in trainers:
            nursery.start_soon(functools.partial(trainer.train, handle_signals=False))
    assert [b.step for b in backends] == [4, 2]
    assert sorted(i for c in backends[1].calls for i in c.scenario_ids) == [0, 1, 2, 3]
