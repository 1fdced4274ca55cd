"""A trio program that trains beside its own services.

The trainer is one task of your nursery: ``await nursery.start(trainer.train)`` returns once
every stage runs, a health endpoint serves the trainer's live ``statistics()`` beside it, an
observer hears every step, and ``trainer.resize`` changes the worker count while it runs.
When training ends the program cancels its own services; a cancel scope around the whole
thing would stop the trainer the same way (state saved, nothing left running).

Runs on a CPU: the policy is the numpy demo's (``art_trio.demo``), served by a real
OpenAI-compatible server on 127.0.0.1.

    python examples/trio_services.py          # writes under ./.art
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import httpx  # noqa: E402
import trio  # noqa: E402

from art_trio import (  # noqa: E402
    PipelineRuntimeConfig,
    PipelineTrainer,
    StepTrained,
    trainable_model,  # noqa: E402
)
from art_trio.demo import (  # noqa: E402
    CpuBackend,
    TaskConfig,
    eval_fn,
    rollout,
    scenarios,
    start_over,
)

STEPS = 4


# --8<-- [start:health]
async def serve_health(
    trainer: PipelineTrainer, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A tiny HTTP endpoint on 127.0.0.1 answering every request with the live statistics."""

    async def answer(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)  # the request; every path gets the same answer
        stats = trainer.statistics()
        body = json.dumps(
            {"running": stats.running, "steps": stats.steps,
             "policy_version": stats.policy_version,
             "rollouts_in_flight": stats.rollouts_in_flight,
             "num_rollout_workers": stats.num_rollout_workers}
        ).encode()  # fmt: skip
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        await stream.send_all(head.encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        port = listeners[0].socket.getsockname()[1]
        await nursery.start(trio.serve_listeners, answer, listeners)
        task_status.started(port)


# --8<-- [end:health]


async def read_health(port: int) -> dict[str, object]:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"http://127.0.0.1:{port}/health")).json()


async def main() -> None:
    # --8<-- [start:build]
    model = trainable_model(name="trio-services", project="examples", base_model="cpu-demo")
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    async with CpuBackend(seed=0) as backend:  # any ART backend
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            rollout,  # your asyncio rollout_fn, unchanged
            scenarios(0),
            TaskConfig(),
            eval_fn,
            pipeline=PipelineRuntimeConfig(num_rollout_workers=2, min_batch_size=2),
            max_steps_off_policy=1,
            max_steps=STEPS,
        )
        # --8<-- [end:build]

        # --8<-- [start:observe]
        steps_heard: list[int] = []

        def observe(event: object) -> None:  # called in the trainer's task: must not block
            if isinstance(event, StepTrained):
                steps_heard.append(event.step)
                if len(steps_heard) == 1:  # more workers once the first step is in
                    trainer.resize(num_rollout_workers=4, reason="first step trained")

        trainer.add_observer(observe)
        # --8<-- [end:observe]

        # --8<-- [start:nursery]
        async with trio.open_nursery() as services:
            port = await services.start(serve_health, trainer)  # your own service
            async with trio.open_nursery() as training:
                await training.start(trainer.train)  # returns once every stage runs
                health = await read_health(port)  # live statistics, while it trains
                print("health while training:", health)
            services.cancel_scope.cancel()  # train() returned: stop our own services too
        # --8<-- [end:nursery]

    if trainer.stop_signal:  # Ctrl-C (or SIGTERM) stopped it cleanly, state saved:
        raise SystemExit(128 + trainer.stop_signal)  # exit as an interrupted program (130)
    stats = trainer.statistics()
    print(
        f"trained {stats.steps} steps (heard {steps_heard}), "
        f"workers now {stats.num_rollout_workers}"
    )
    assert health["running"] and stats.steps == STEPS and stats.num_rollout_workers == 4


if __name__ == "__main__":
    trio.run(main)
