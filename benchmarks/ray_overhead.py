"""What a rollout costs on RayRolloutExecutor against the in-process executor.

    python benchmarks/ray_overhead.py                 # a local Ray (2 CPUs, 200 MB store)
    RAY_ADDRESS=host:port python benchmarks/ray_overhead.py   # an existing cluster

Measures, for a no-op asyncio rollout returning a two-trajectory `art.TrajectoryGroup`:
1. latency: one rollout at a time (in-process vs Ray), median of `--latency-n` calls;
2. throughput: `--workers` concurrent workers pushing `--throughput-n` rollouts, with the
   calling process's CPU time per rollout;
3. concurrency: N concurrent `run` calls of `asyncio.sleep(1)` and the wall time they take;
4. memory: peak RSS of the calling process after `--groups` small groups came through.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
import ray  # noqa: E402

from art_trio import InProcessExecutor, RayRolloutExecutor, trainable_model  # noqa: E402


async def noop_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[], reward=float(i)) for i in range(2)]
    )


async def sleep_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    await asyncio.sleep(scenario["sleep"])
    return await noop_rollout(model, scenario, config)


class BareActor:
    """Ray's own floor: an async actor method doing nothing, called with the same scenario."""

    async def run(self, scenario: Any) -> None:
        return None


class BareExecutor:
    def __init__(self) -> None:
        self.actor = ray.remote(BareActor).options(num_cpus=0, max_concurrency=2000).remote()

    async def run(self, worker: int, fn: Any, model: Any, scenario: Any, config: Any) -> Any:
        return await self.actor.run.remote(scenario)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def latency(executor: Any, model: Any, n: int) -> float:
    samples = []
    for i in range(n):
        begin = time.perf_counter()
        await executor.run(0, noop_rollout, model, {"id": i}, None)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples) * 1e6


async def throughput(executor: Any, model: Any, n: int, workers: int) -> tuple[float, float]:
    """(rollouts per second, calling-process CPU microseconds per rollout)."""
    queue = iter(range(n))

    async def worker(w: int) -> None:
        for i in queue:
            await executor.run(w, noop_rollout, model, {"id": i}, None)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return n / wall, cpu / n * 1e6


async def concurrent_sleeps(executor: Any, model: Any, n: int) -> float:
    begin = time.perf_counter()
    groups = await asyncio.gather(
        *(executor.run(i, sleep_rollout, model, {"sleep": 1.0}, None) for i in range(n))
    )
    assert len(groups) == n and all(isinstance(g, art.TrajectoryGroup) for g in groups)
    return time.perf_counter() - begin


async def main(args: argparse.Namespace) -> None:
    model = trainable_model(name="bench", project="ray", base_model="none", base_path="/tmp")
    model.inference_base_url, model.inference_api_key = "http://127.0.0.1:9/v1", "k"
    local = InProcessExecutor()
    remote = RayRolloutExecutor(num_actors=args.actors, max_concurrency=args.max_concurrency)
    places = await remote.where()
    nodes = len({p["node_id"] for p in places})
    print(f"ray {ray.__version__}, {len(places)} actors on {nodes} node(s)")
    await latency(remote, model, 50)  # warm-up: function and model cached on every actor
    remote.set_workers(tuple(range(max(args.workers, max(args.concurrency)))))

    bare = BareExecutor()
    await latency(bare, model, 50)

    in_us = await latency(local, model, args.latency_n)
    ray_us = await latency(remote, model, args.latency_n)
    bare_us = await latency(bare, model, args.latency_n)
    print(
        f"latency, one at a time: in-process {in_us:.1f} us, Ray executor {ray_us:.0f} us "
        f"per rollout (a bare Ray actor call: {bare_us:.0f} us)"
    )
    in_rate, in_cpu = await throughput(local, model, args.throughput_n, args.workers)
    rate, cpu = await throughput(remote, model, args.throughput_n, args.workers)
    bare_rate, bare_cpu = await throughput(bare, model, args.throughput_n, args.workers)
    print(
        f"throughput, {args.workers} workers: in-process {in_rate:,.0f}/s ({in_cpu:.0f} us "
        f"CPU each), Ray executor {rate:,.0f}/s ({cpu:.0f} us CPU each in the calling "
        f"process; a bare Ray actor call: {bare_rate:,.0f}/s, {bare_cpu:.0f} us)"
    )
    ray.kill(bare.actor)
    for n in args.concurrency:
        walls = [await concurrent_sleeps(remote, model, n) for _ in range(3)]
        print(
            f"concurrency: {n} concurrent 1 s rollouts finished in "
            f"{statistics.median(walls):.2f} s (median of {', '.join(f'{w:.2f}' for w in walls)})"
        )

    before = rss_mb()
    done = 0
    checkpoints = sorted({min(args.groups, 10_000), args.groups})
    for target in checkpoints:
        await throughput(remote, model, target - done, args.workers)
        done = target
        print(
            f"memory: after {done:,} groups RSS {rss_mb():.0f} MB "
            f"(peak {peak_rss_mb():.0f} MB, {before:.0f} MB before)"
        )
    remote.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=2000)
    parser.add_argument("--latency-n", type=int, default=500)
    parser.add_argument("--throughput-n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--groups", type=int, default=100_000)
    args = parser.parse_args()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # A private instance on this machine: no token auth, and so no token written to
            # ~/.ray (Ray 2.60 generates one there for a local ray.init by default).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(
                num_cpus=2,
                object_store_memory=200_000_000,
                include_dashboard=False,
                log_to_driver=False,
            )
    try:
        asyncio.run(main(args))
    finally:
        ray.shutdown()
