"""RayRolloutExecutor on a real two-node Ray cluster (127.0.0.1, two `ray start` nodes).

No mock of Ray: the rollouts in tests/ray_rollouts.py run in Ray worker processes the cluster
starts, cancellation and kill -9 hit those processes, and the failures come back over Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio.executors import InProcessExecutor, RolloutExecutor
from art_trio.messages.errors import RolloutLost
from tests import ray_rollouts

ray = pytest.importorskip("ray")

from art_trio.executors.ray import RayActorsNotPlaced, RayRolloutExecutor  # noqa: E402
from tests.ray_cluster import AUTH_ENV, RayCluster  # noqa: E402

# -- without a cluster ------------------------------------------------------------------------


def test_importing_art_trio_does_not_import_ray() -> None:
    code = (
        "import sys, art_trio\n"
        "assert 'ray' not in sys.modules, 'import art_trio imported ray'\n"
        "assert 'art_trio.executors.ray' not in sys.modules\n"
        "cls = art_trio.RayRolloutExecutor\n"
        "assert 'ray' in sys.modules and cls.__module__ == 'art_trio.executors.ray'\n"
        "assert 'RayRolloutExecutor' in dir(art_trio)\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_in_process_executor_awaits_the_rollout(model: art.TrainableModel) -> None:
    executor = InProcessExecutor()
    assert isinstance(executor, RolloutExecutor)
    assert executor.max_workers is None
    executor.set_target(4)
    executor.set_workers((0, 1, 2, 3))
    with pytest.raises(ValueError):
        executor.set_target(0)

    async def rollout(m: Any, scenario: Any, config: Any) -> tuple[Any, Any, Any]:
        await asyncio.sleep(0)
        return m, scenario, config

    assert asyncio.run(executor.run(0, rollout, model, {"id": 1}, "cfg")) == (
        model, {"id": 1}, "cfg",
    )  # fmt: skip


# -- the cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    # One `art_trio_slot` on the head: an actor asking for one fits there, a second nowhere.
    cluster = RayCluster(nodes=2, cpus_per_node=2, timeout=120,
                         head_resources={"art_trio_slot": 1}).start()
    added = {"RAY_ADDRESS": cluster.address, **AUTH_ENV}
    saved = {key: os.environ.get(key) for key in added}
    os.environ.update(added)
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not cluster.pids(), "Ray processes left running"


@pytest.fixture(scope="module")
def executor(cluster: RayCluster) -> Iterator[RayRolloutExecutor]:
    assert not ray.is_initialized()
    # No arguments: ray.init() finds the cluster (RAY_ADDRESS), one actor per CPU (2 x 2).
    executor = RayRolloutExecutor()
    try:
        places = asyncio.run(asyncio.wait_for(executor.where(), 120))
        assert len(places) == 4
        # The executor marks an actor placed when its own probe answers, which can come after
        # the calls above on a loaded machine: until then its workers' rollouts go elsewhere.
        assert asyncio.run(asyncio.wait_for(executor.placed(), 120)) == [0, 1, 2, 3]
        yield executor
    finally:
        executor.shutdown()


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_connects_to_the_cluster_ray_init_finds(cluster, executor) -> None:
    assert isinstance(executor, RolloutExecutor)
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2
    assert ray.get_runtime_context().gcs_address == cluster.address
    assert executor.max_workers == 4 * 1000
    with pytest.raises(ValueError):
        executor.set_target(4001)
    executor.set_target(64)


def test_groups_come_back_from_workers_on_both_nodes(executor, model) -> None:
    executor.set_workers(tuple(range(8)))

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(
                executor.run(w, ray_rollouts.where_rollout, model, {"id": w, "sleep": 0.2}, "c")
                for w in range(8)
            )
        )

    groups = run(main())
    assert all(isinstance(group, art.TrajectoryGroup) for group in groups)
    assert [g.trajectories[0].messages_and_choices[0]["content"] for g in groups] == [
        str(w) for w in range(8)
    ]
    assert [t.reward for t in groups[0].trajectories] == [0.0, 1.0]
    meta = [g.trajectories[0].metadata for g in groups]
    assert {m["pid"] for m in meta}.isdisjoint({str(os.getpid())})
    assert len({m["node_id"] for m in meta}) == 2, "rollouts ran on one node only"
    assert len({m["pid"] for m in meta}) == 4  # 8 workers spread over the 4 actors
    # The trainer-side inference name (RecordingBackend: name@step) reached the worker.
    assert {m["inference_name"] for m in meta} == {model.get_inference_name()}
    assert {m["model_class"] for m in meta} == {type(model).__name__}
    assert {m["config"] for m in meta} == {"c"}


def test_a_closure_rollout_is_shipped_by_value(executor, model) -> None:
    bonus = 41.0

    async def closure_rollout(m: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(0.01)
        return art.TrajectoryGroup(
            [art.Trajectory(messages_and_choices=[], reward=bonus + scenario["id"])]
        )

    group = run(executor.run(3, closure_rollout, model, {"id": 1}, None))
    assert group.trajectories[0].reward == 42.0


class _ChatServer(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        )
        reply = {
            "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": f"hello from {body['model']}"},
            }],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_model_reaches_its_inference_endpoint_from_the_worker(executor, model) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        model.inference_base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        model.inference_api_key = "secret-key"
        group = run(executor.run(0, ray_rollouts.chat_rollout, model, {"prompt": "hi"}, None))
    finally:
        server.shutdown()
        server.server_close()
    (seen,) = _ChatServer.seen
    assert seen["path"] == "/v1/chat/completions"
    assert seen["auth"] == "Bearer secret-key"
    assert seen["body"]["model"] == model.get_inference_name()
    trajectory = group.trajectories[0]
    assert trajectory.metadata["pid"] != str(os.getpid())
    choice = trajectory.messages_and_choices[1]
    assert choice.message.content == f"hello from {model.get_inference_name()}"


def _hour_scenario(tmp_path: Path) -> dict[str, Any]:
    marks = tmp_path / "marks"
    marks.mkdir()
    return {"id": "hour", "marks": str(marks)}


async def _until_started(marks: Path, limit: float = 60) -> int:
    deadline = time.monotonic() + limit
    while not (marks / "started").exists():
        assert time.monotonic() < deadline, "the remote rollout never started"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    return int((marks / "started").read_text())


def test_cancelling_run_cancels_the_rollout_on_its_node(executor, model, tmp_path) -> None:
    scenario = _hour_scenario(tmp_path)
    marks = Path(scenario["marks"])

    async def main() -> float:
        task = asyncio.create_task(executor.run(1, ray_rollouts.hour_rollout, model, scenario, 0))
        pid = await _until_started(marks)
        assert pid != os.getpid()
        begin = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - begin
        # run() waited for the node to confirm: the rollout's own handlers already ran there.
        assert (marks / "cancelled").read_text() == str(pid)
        assert (marks / "finally").read_text() == str(pid)
        return took

    assert run(main()) < 2.0
    # The actor is alive and serves the next rollout.
    group = run(executor.run(1, ray_rollouts.where_rollout, model, {"id": 9}, None))
    assert len(group.trajectories) == 2


async def test_cancelling_from_trio_through_the_bridge_cancels_remotely(
    executor, model, tmp_path
) -> None:
    """The trainer's path: a trio cancel scope, trio-asyncio, then run() in an asyncio task."""
    from art_trio.plumbing.bridge.calls import open_bridge

    scenario = _hour_scenario(tmp_path)
    marks = Path(scenario["marks"])
    async with open_bridge() as bridge:
        group = await bridge.call(
            executor.run, 2, ray_rollouts.where_rollout, model, {"id": 5}, None
        )
        assert isinstance(group, art.TrajectoryGroup)
        with trio.move_on_after(60) as scope:
            async with trio.open_nursery() as nursery:

                async def rollout() -> None:
                    hour = ray_rollouts.hour_rollout
                    await bridge.call(executor.run, 2, hour, model, scenario, 0)

                nursery.start_soon(rollout)
                while not (marks / "started").exists():  # noqa: ASYNC110  (a file on disk)
                    await trio.sleep(0.05)
                await trio.sleep(0.1)
                begin = trio.current_time()
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert trio.current_time() - begin < 2.0
    assert (marks / "finally").read_text() == (marks / "started").read_text()


def test_a_failing_rollout_raises_its_own_type_with_scenario_and_remote_traceback(
    executor, model
) -> None:
    scenario = {"prompt": "2+2", "metadata": {"scenario_id": "sc-17"}}
    with pytest.raises(ValueError) as caught:
        run(executor.run(0, ray_rollouts.failing_rollout, model, scenario, None))
    message = str(caught.value)
    assert "no answer for prompt '2+2'" in message
    assert "'sc-17'" in message
    assert "ray_rollouts.py" in message and "_fail_deep" in message  # the remote frames
    remote_pid = message.split("(pid ")[-1].split(")")[0]
    assert remote_pid != str(os.getpid())
    # Scenario ids from `scenario.metadata` objects and `scenario["id"]` too.
    with pytest.raises(ValueError, match="'sc-18'"):
        run(executor.run(0, ray_rollouts.failing_rollout, model, {"id": "sc-18", "prompt": ""}, 0))


def test_kill_9_of_the_worker_process_mid_rollout_is_a_lost_rollout(
    executor, model, tmp_path
) -> None:
    scenario = _hour_scenario(tmp_path)
    marks = Path(scenario["marks"])

    async def main() -> BaseException:
        task = asyncio.create_task(executor.run(3, ray_rollouts.hour_rollout, model, scenario, 0))
        pid = await _until_started(marks)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RolloutLost) as caught:
            await task
        return caught.value

    lost = run(main())
    assert isinstance(lost.__cause__, ray.exceptions.RayActorError)
    assert "'hour'" in str(lost)
    assert not (marks / "finally").exists()  # it never finished: nothing ran its finally
    # The next rollouts of that worker go to a live actor while Ray restarts this one...
    group = run(executor.run(3, ray_rollouts.where_rollout, model, {"id": 10}, None), 10)
    assert group.trajectories[0].metadata["pid"] != (marks / "started").read_text()

    # ...and once it answers again the worker is back on its own actor, in a new process.
    async def back() -> dict[str, Any]:
        while True:
            group = await executor.run(3, ray_rollouts.where_rollout, model, {"id": 11}, None)
            metadata: dict[str, Any] = group.trajectories[0].metadata
            if not executor._down:
                return metadata
            await asyncio.sleep(0.5)

    restarted = run(back(), 90)
    places = run(executor.where())
    assert restarted["pid"] in {str(p["pid"]) for p in places}
    assert str(places[executor._assigned[3]]["pid"]) not in {(marks / "started").read_text()}


def test_set_workers_spreads_workers_over_actors_and_keeps_assignments(executor) -> None:
    executor.set_workers((0, 1, 2, 3, 4, 5, 6, 7))
    first = dict(executor._assigned)
    assert sorted(first.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    executor.set_workers((0, 1, 2, 3, 4, 5, 6, 7, 8, 9))
    assert all(executor._assigned[w] == first[w] for w in range(8))
    executor.set_workers((2, 3))
    assert executor._assigned == {2: first[2], 3: first[3]}


# -- actors the cluster cannot place (issue 25, case 5) -----------------------------------------


def test_actors_that_fit_counts_per_node() -> None:
    from art_trio.executors.ray_placement import actors_that_fit

    two = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 8e9}},
           {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
           {"Alive": False, "Resources": {"CPU": 64.0}}]
    assert actors_that_fit({"num_cpus": 1}, two) == 4
    assert actors_that_fit({"num_cpus": 2}, two) == 2
    assert actors_that_fit({"num_cpus": 3}, two) == 0  # 4 CPUs in all, but 2 per node
    assert actors_that_fit({"num_cpus": 1, "num_gpus": 1}, two) == 1
    assert actors_that_fit({"num_cpus": 0, "resources": {"slot": 1}}, two) == 0
    assert actors_that_fit({"num_cpus": 0}, two) is None  # asks for nothing: no limit


def test_actor_options_no_node_can_host_are_refused_at_once(executor) -> None:
    with pytest.raises(ValueError) as caught:
        RayRolloutExecutor(actor_options={"num_cpus": 3})
    message = str(caught.value)
    assert "'num_cpus': 3" in message and "'CPU': 2" in message and "2 live nodes" in message


def _few(n: int) -> list[dict[str, Any]]:
    return [{"metadata": {"scenario_id": i}, "sleep": 0.05} for i in range(n)]


async def test_actors_the_cluster_cannot_place_end_the_run_with_a_clear_error(
    executor: RayRolloutExecutor, model: art.TrainableModel, backend: Any
) -> None:
    """The issue's case: two CPUs per actor while the module's pool holds every CPU. Before,
    the workers waited for ever and their scenarios were discarded as stale unrolled."""
    from art_trio import PipelineTrainer

    stuck = RayRolloutExecutor(actor_options={"num_cpus": 2}, placement_timeout=3)
    try:
        assert stuck.max_workers == 2 * 1000  # sized to the nodes: one per two CPUs of each
        trainer = PipelineTrainer(
            model, backend, ray_rollouts.sleep_rollout, _few(4), None, rollout_executor=stuck,
            num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps_off_policy=0,
        )
        with trio.fail_after(60):  # it waited for ever
            with pytest.raises(BaseExceptionGroup) as caught:
                await trainer.train(handle_signals=False)
    finally:
        stuck.shutdown()
    leaves = _leaves(caught.value)  # each worker's rollout raised it
    assert leaves and all(isinstance(e, RayActorsNotPlaced) for e in leaves), leaves
    assert re.search(r"(?s)'num_cpus': 2.*'CPU': 4.*'CPU': 0.*free now", str(leaves[0]))
    counters = trainer.last_counters
    assert counters is not None and not backend.calls
    # Nothing discarded: no scenario counted stale or errored; a resume rolls them.
    assert counters.stale == 0 and counters.errored == 0 and counters.trained == 0


async def test_a_pool_part_of_which_cannot_be_placed_runs_on_the_placed_actors(
    executor: RayRolloutExecutor, model: art.TrainableModel, backend: Any, caplog: Any
) -> None:
    from art_trio import PipelineTrainer

    half = RayRolloutExecutor(
        num_actors=2, actor_options={"num_cpus": 0, "resources": {"art_trio_slot": 1}},
        placement_timeout=30,  # a Ray worker process takes seconds to start on 2 busy cores
    )
    try:
        caplog.set_level("WARNING", logger="art_trio")
        placed = await trio_asyncio_run(half.placed)
        assert len(placed) == 1
        unplaced = 1 - placed[0]
        warned = [r.getMessage() for r in caplog.records if "not placed" in r.getMessage()]
        named = re.search(r"actors \[([0-9, ]+)\] of 2", warned[0]) if warned else None
        # (On a busy machine the placed one may have answered late too, and be named.)
        assert named and str(unplaced) in named.group(1).split(", "), warned
        assert "art_trio_slot" in warned[0]  # what each asks for, and the cluster has
        trainer = PipelineTrainer(
            model, backend, ray_rollouts.sleep_rollout, _few(8), None, rollout_executor=half,
            num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
            max_steps_off_policy=1000,
        )
        with trio.fail_after(60):
            await trainer.train(handle_signals=False)  # returns: the source is finite
    finally:
        half.shutdown()
    trained = [sid for call in backend.calls for sid in call.scenario_ids]
    assert sorted(trained) == list(range(8))
    counters = trainer.last_counters
    assert counters is not None and counters.stale == 0 and counters.errored == 0


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


async def trio_asyncio_run(fn: Any) -> Any:
    """Run an asyncio coroutine function from a trio test (what the trainer's bridge does)."""
    import trio_asyncio

    async with trio_asyncio.open_loop():
        return await trio_asyncio.aio_as_trio(fn)()


def test_without_ray_installed_the_error_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if not installed\n"
        "import art_trio\n"
        "try:\n"
        "    art_trio.RayRolloutExecutor\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                         capture_output=True, text=True).stdout
    assert "pip install 'art-trio[ray]'" in out


def test_losing_a_node_mid_rollout_loses_only_its_rollouts(cluster, executor, model, tmp_path):
    """Last in the module: kill -9 every process of the second node (raylet, agents, workers)."""
    places = run(executor.where())
    node1 = cluster.session_pids(1)
    on_node1 = [i for i, p in enumerate(places) if p["pid"] in node1]
    on_head = [i for i, p in enumerate(places) if p["pid"] not in node1]
    assert on_node1 and on_head, places
    executor.set_workers(tuple(range(len(places))))
    workers = {i: next(w for w, a in executor._assigned.items() if a == i) for i in range(4)}
    for i in range(4):
        (tmp_path / str(i)).mkdir()
    scenarios = {i: _hour_scenario(tmp_path / str(i)) for i in range(4)}

    async def main() -> dict[int, BaseException | None]:
        tasks = {
            i: asyncio.create_task(
                executor.run(workers[i], ray_rollouts.hour_rollout, model, scenarios[i], 0)
            )
            for i in range(4)
        }
        for i in range(4):
            await _until_started(Path(scenarios[i]["marks"]))
        for pid in cluster.session_pids(1):
            # A short-lived process of the node (a worker starting or exiting) can be gone
            # between listing and killing: gone is what this wants.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lost = {}
        for i in on_node1:
            with pytest.raises(RolloutLost) as caught:
                await asyncio.wait_for(tasks[i], 30)
            lost[i] = caught.value
        # The head's rollouts were untouched: still running, then cancelled as usual.
        for i in on_head:
            assert not tasks[i].done()
            tasks[i].cancel()
        for i in on_head:
            with pytest.raises(asyncio.CancelledError):
                await tasks[i]
            assert (Path(scenarios[i]["marks"]) / "finally").exists()
        return lost

    lost = run(main(), 120)
    assert all(isinstance(e.__cause__, ray.exceptions.RayError) for e in lost.values())
    # The lost node's workers go on at once on the head's actors.
    for i in on_node1:
        group = run(executor.run(workers[i], ray_rollouts.where_rollout, model, {"id": i}, 0), 10)
        assert group.trajectories[0].metadata["pid"] in {str(places[j]["pid"]) for j in on_head}


async def test_a_training_run_through_ray_rolls_a_killed_workers_scenario_again(
    executor: RayRolloutExecutor, model: art.TrainableModel, backend: Any, tmp_path: Path
) -> None:
    """The trainer under trio, asyncio rollouts on the cluster, one worker kill -9'd mid-run:
    every scenario is trained exactly once and the lost one was rolled again."""
    import trio

    from art_trio import PipelineTrainer

    scenarios = [
        {"metadata": {"scenario_id": i}, "sleep": 0.3, "marks": str(tmp_path)} for i in range(16)
    ]
    trainer = PipelineTrainer(
        model, backend, ray_rollouts.marked_rollout, scenarios, None,
        rollout_executor=executor, num_rollout_workers=4, min_batch_size=2, max_batch_size=2,
        # Ray may take seconds to notice the dead worker; a window that never closes keeps
        # the killed rollout from being cancelled as stale meanwhile (then it would count as
        # discarded, not be rolled again).
        max_steps_off_policy=1000,
    )
    victim = tmp_path / "5.pid"
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer.train)
            # Another process writes it (the Ray worker running scenario 5): no event to await.
            while not victim.exists():  # noqa: ASYNC110
                await trio.sleep(0.02)
            os.kill(int(victim.read_text()), signal.SIGKILL)
    trained = [sid for call in backend.calls for sid in call.scenario_ids]
    assert sorted(trained) == list(range(16))  # none lost, none twice
    counters = trainer.last_counters
    assert counters is not None and counters.rollouts_lost >= 1
    assert counters.errored == 0 and counters.stale == 0


def test_kill_9_of_the_trainer_then_resume_trains_each_scenario_once(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """The trainer process itself dies mid-run (its Ray rollouts with it); a new process
    resumes from the directory with a new executor. Nothing trained twice, nothing skipped."""
    from art_trio.resume.state import PipelineState
    from tests.crash_harness import TRAINED_LOG, read_trained

    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "tests.ray_crash_child", str(tmp_path), "12"]
    child = subprocess.Popen(
        command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = child.stdout
    assert stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    try:
        # Waits on the child's own report of its 4th durable step (120 s: it never came).
        while not lines.get(timeout=120).startswith("@ step 4"):
            pass
    finally:
        child.kill()
        child.wait(30)
    resumed = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_trained(tmp_path / TRAINED_LOG)
    assert [r["step"] for r in records] == list(range(1, 13))
    trained = [i for r in records for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a scenario was trained twice"
    state = json.loads((tmp_path / ".art/p/models/ray-crash/state.json").read_text())
    watermark = PipelineState.from_json(state["_pipeline_trainer"]).ledger.watermark
    assert set(range(watermark)) <= set(trained), "a scenario below the watermark was skipped"
