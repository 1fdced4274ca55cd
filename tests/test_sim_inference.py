"""Inference contention, latency shifts and the trainer's CPU in the simulator, all in virtual
time (MockClock).

The processor-sharing server's latencies are computed by hand: with capacity C and n
requests in flight each progresses at min(1, C / n) seconds of service per second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
import trio_asyncio

from art_trio.sim.doubles import make_rollout_fn
from art_trio.sim.host import HostCPU
from art_trio.sim.inference import LatencyShift, ProcessorSharing
from art_trio.sim.recorder import Recorder, StepRecord
from art_trio.sim.simulate import SimSpec, simulate
from art_trio.sim.workloads import PRESETS, TUNING_WORKLOADS, Workload
from art_trio.testing.distributions import Constant, Exponential
from tests.test_simulator import HAND, reference_race


def _run(fn: Any) -> Any:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def _serve_all(
    server: ProcessorSharing, jobs: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Start each job (name -> (start delay, work)) and return when each finished."""
    ended: dict[str, float] = {}
    t0 = trio.current_time()

    async def job(name: str, delay: float, work: float) -> None:
        await trio.sleep(delay)
        await server.serve(work)
        ended[name] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for name, (delay, work) in jobs.items():
            nursery.start_soon(job, name, delay, work)
    return ended


@pytest.mark.parametrize(("n", "latency"), [(1, 10.0), (4, 10.0), (8, 20.0), (12, 30.0)])
def test_latency_grows_with_the_number_in_flight(n: int, latency: float) -> None:
    server = ProcessorSharing(4)
    ended = _run(lambda: _serve_all(server, {str(i): (0.0, 10.0) for i in range(n)}))
    assert ended == {str(i): pytest.approx(latency) for i in range(n)}
    assert server.max_in_flight == n and server.in_flight == 0


def test_an_arrival_slows_the_requests_already_running() -> None:
    # Capacity 2. a and b run alone at full speed for 5 s (5 s of service each); c arrives
    # and all three get 2/3 speed: c needs 2 s of service, done after 3 s (t=8), by which
    # time a and b have 7 s; alone again, they finish their last 3 s at t=11.
    server = ProcessorSharing(2)
    ended = _run(
        lambda: _serve_all(server, {"a": (0.0, 10.0), "b": (0.0, 10.0), "c": (5.0, 2.0)})
    )
    assert ended == {"a": pytest.approx(11.0), "b": pytest.approx(11.0), "c": pytest.approx(8.0)}


def test_a_cancelled_request_frees_its_share() -> None:
    # Capacity 2, four requests of 10 s: half speed each. Two are cancelled at t=4 (2 s of
    # service each so far); the other two need 8 s more at full speed: done at t=12.
    server = ProcessorSharing(2)

    async def main() -> dict[str, float]:
        ended: dict[str, float] = {}

        async def job(name: str) -> None:
            await server.serve(10.0)
            ended[name] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(job, "kept-1")
            nursery.start_soon(job, "kept-2")
            with trio.move_on_after(4.0):
                async with trio.open_nursery() as doomed:
                    doomed.start_soon(job, "cancelled-1")
                    doomed.start_soon(job, "cancelled-2")
        return ended

    assert _run(main) == {"kept-1": pytest.approx(12.0), "kept-2": pytest.approx(12.0)}
    assert server.in_flight == 0


def test_the_asyncio_flavor_through_trio_asyncio_in_virtual_time() -> None:
    server = ProcessorSharing(2, flavor="asyncio")

    async def main() -> list[float]:
        async with trio_asyncio.open_loop() as loop:

            async def one() -> float:
                await server.serve(10.0)
                return loop.time()

            async def three() -> list[float]:
                import asyncio

                return list(await asyncio.gather(one(), one(), one()))

            start = trio.current_time()
            ends = await trio_asyncio.aio_as_trio(three)()
            return [end - start for end in ends]

    assert _run(main) == [pytest.approx(15.0)] * 3


def _workload(**changes: Any) -> Workload:
    base: dict[str, Any] = dict(
        name="t",
        workers=8,
        rollout_latency=Constant(10.0),
        train_time=Constant(1.0),
        min_batch=1,
        max_batch=1,
        max_steps_off_policy=1,
    )
    base.update(changes)
    return Workload(**base)


@pytest.mark.parametrize(("in_flight", "latency"), [(2, 10.0), (4, 10.0), (8, 20.0), (16, 40.0)])
def test_the_rollout_double_waits_at_a_server_of_limited_capacity(
    in_flight: int, latency: float
) -> None:
    recorder = Recorder()
    rollout = make_rollout_fn(_workload(inference_capacity=4), recorder)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(in_flight):
                nursery.start_soon(rollout, None, {"id": i}, None)

    _run(main)
    took = [recorder.rollout_end[i] - recorder.rollout_start[i] for i in range(in_flight)]
    assert took == [pytest.approx(latency)] * in_flight


def test_the_rollout_double_applies_a_latency_shift_after_the_given_step() -> None:
    recorder = Recorder()
    rollout = make_rollout_fn(_workload(latency_shift=LatencyShift(2, 2.0)), recorder)

    def finish_step(n: int) -> None:
        recorder.steps.append(StepRecord(step=n, base_version=n - 1, start=0, end=0, n_groups=1))

    async def main() -> None:
        await rollout(None, {"id": 0}, None)  # no step done
        finish_step(1)
        await rollout(None, {"id": 1}, None)  # one step done
        finish_step(2)
        await rollout(None, {"id": 2}, None)  # two steps done: doubled

    _run(main)
    took = [recorder.rollout_end[i] - recorder.rollout_start[i] for i in range(3)]
    assert took == [pytest.approx(10.0), pytest.approx(10.0), pytest.approx(20.0)]


def test_the_host_cpu_serves_one_charge_at_a_time_in_order() -> None:
    cpu = HostCPU()

    async def main() -> list[float]:
        done: list[float] = []

        async def use(seconds: float) -> None:
            await cpu.spend(seconds)
            done.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for seconds in (1.0, 2.0, 0.5):
                nursery.start_soon(use, seconds)
                await trio.lowlevel.checkpoint()  # start them in this order
        cpu.charge(3.0)  # booked without waiting (a cancelled rollout's clean-up)
        await use(1.0)  # waits behind it
        return done

    assert _run(main) == [pytest.approx(t) for t in (1.0, 3.0, 3.5, 7.5)]


def test_the_rollout_double_pays_cpu_on_one_core_at_start_and_end() -> None:
    # 4 rollouts of 10 s started together, 1 s of CPU each (0.5 s at start, 0.5 s at the
    # end): the starts queue for the core (0.5, 1.0, 1.5, 2.0); the ends queue behind each
    # other as they come back (10.5 -> 11.0, 11.0 -> 11.5, ...).
    recorder = Recorder()
    rollout = make_rollout_fn(_workload(rollout_cpu_s=1.0), recorder)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(rollout, None, {"id": i}, None)
                await trio.lowlevel.checkpoint()

    _run(main)
    assert [recorder.rollout_start[i] for i in range(4)] == [
        pytest.approx(t) for t in (0.5, 1.0, 1.5, 2.0)
    ]
    assert [recorder.rollout_end[i] for i in range(4)] == [
        pytest.approx(t) for t in (11.0, 11.5, 12.0, 12.5)
    ]
    with pytest.raises(ValueError, match="rollout_cpu_s"):
        _workload(rollout_cpu_s=-1.0)


# --- end to end, through the real trainer --------------------------------------------------------

# test_simulator's hand-computed run: 8 workers, batch 4, on-policy, rollouts 10 s, train
# 20 s, 5 steps. Each step's 8 rollouts start together at the new version and finish together.


@pytest.fixture
def full_race() -> Iterator[None]:
    with reference_race():
        yield


@pytest.mark.usefixtures("full_race")
def test_simulated_contention_slows_the_run_as_computed_by_hand() -> None:
    plain = simulate(HAND)
    assert plain.sim_wall_s == pytest.approx(150.0)
    # 8 rollouts in flight on a server for 4: each takes 20 s; steps every 40 s.
    r = simulate(SimSpec(**{**HAND.__dict__, "inference_capacity": 4}))
    assert r.sim_wall_s == pytest.approx(5 * 40.0)
    assert r.rollout_s == pytest.approx(40 * 20.0)
    assert r.trainer_utilization == pytest.approx(100 / 180)
    assert r.spec["inference_capacity"] == 4
    # Room for all 8: the same as no contention at all.
    roomy = simulate(SimSpec(**{**HAND.__dict__, "inference_capacity": 8}))
    assert roomy.sim_wall_s == pytest.approx(150.0)


@pytest.mark.usefixtures("full_race")
def test_simulated_latency_doubling_at_a_step() -> None:
    # Step 1's rollouts start with no step done, step 2's after one: 10 s. From step 3 on the
    # rollouts start after two steps and take 20 s: 2 x 30 s + 3 x 40 s.
    r = simulate(SimSpec(**{**HAND.__dict__, "latency_shift": LatencyShift(2, 2.0)}))
    assert r.sim_wall_s == pytest.approx(60.0 + 120.0)
    assert r.rollout_s == pytest.approx(16 * 10.0 + 24 * 20.0)
    assert r.spec["latency_shift"] == {"after_steps": 2, "factor": 2.0}


def test_more_workers_than_the_server_holds_only_slows_rollouts() -> None:
    # With contention, doubling the workers past the server's capacity makes each trained
    # group cost more rollout-seconds and feeds the trainer no better: the case the autotuner
    # must recognise. (Exponential draws: no ties, whose order trio's scheduler randomises.)
    spec = SimSpec(
        rollout_latency=Exponential(10.0),
        train_time=Constant(20.0),
        steps=30,
        inference_capacity=4,
        trainer={"min_batch_size": 4, "max_batch_size": 4, "max_steps_off_policy": 1},
    )
    few, many = (simulate(spec.with_trainer(num_rollout_workers=w)) for w in (4, 8))
    assert few.rollout_s_per_trained_group < many.rollout_s_per_trained_group
    assert many.trainer_utilization <= few.trainer_utilization
    # 4 workers never put more than 4 rollouts on the server: as if it had no limit.
    unlimited = SimSpec(**{**spec.__dict__, "inference_capacity": None})
    alone = simulate(unlimited.with_trainer(num_rollout_workers=4))
    assert alone.rollout_s == pytest.approx(few.rollout_s)
    assert alone.sim_wall_s == pytest.approx(few.sim_wall_s)


@pytest.mark.usefixtures("full_race")
def test_cli_inference_capacity_and_latency_shift(capsys: pytest.CaptureFixture[str]) -> None:
    from art_trio.sim.cli import main

    fast = [
        "--rollout-latency", "10", "--train-time", "20", "--steps", "5", "--workers", "8",
        "--min-batch-size", "4", "--max-batch-size", "4", "--max-steps-off-policy", "0",
        "--json", "--no-progress",
    ]  # fmt: skip
    assert main([*fast, "--inference-capacity", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["sim_wall_s"] == pytest.approx(200.0)
    assert main([*fast, "--latency-shift", "2:2"]) == 0
    assert json.loads(capsys.readouterr().out)["sim_wall_s"] == pytest.approx(180.0)
    # The on-policy race of HAND with 1 s of CPU per rollout: slower than free CPU.
    assert main([*fast, "--rollout-cpu", "1s"]) == 0
    with_cpu = json.loads(capsys.readouterr().out)
    assert with_cpu["sim_wall_s"] > 150.0 and with_cpu["spec"]["rollout_cpu_s"] == 1.0
    bad_args = (
        ["--inference-capacity", "0"], ["--latency-shift", "2"], ["--latency-shift", "x:2"],
        ["--rollout-cpu", "fast"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit) as exc:
            main([*fast, *bad])
        assert exc.value.code == 2


def test_tuning_presets() -> None:
    assert set(TUNING_WORKLOADS) <= set(PRESETS)
    assert PRESETS["contention"].inference_capacity is not None
    shift = PRESETS["latency-doubles"].latency_shift
    assert shift is not None and shift.factor == 2.0
    steps = PRESETS["latency-doubles"].steps
    assert steps is not None and shift.after_steps == steps // 2
    assert "inference capacity" in PRESETS["contention"].describe()
    assert not math.isnan(LatencyShift(0, 2.0).scale(0))
    with pytest.raises(ValueError):
        ProcessorSharing(0)
    with pytest.raises(ValueError):
        SimSpec(rollout_latency=Constant(1.0), train_time=Constant(1.0), inference_capacity=0)
