"""How much of art_trio a plain run loads: the kernel's size in code lines.

A plain run is ART's own pipeline on the path its users take, with every art_trio-only
capability switched off through public settings: asyncio rollout code and an asyncio backend
under ``trio.run``, an eval every 2 steps, checkpoints, the status line, ``resume=False``,
``stall_seconds=None``, ``admission="eager"``, no autotune, no executor. After it, every
``art_trio`` module in ``sys.modules`` but the tool packages is counted by radon's raw metrics
(SLOC: code lines; radon leaves blank lines, comments and docstrings out of it).

    python benchmarks/kernel_size.py            # the figure, and each module's lines
    python benchmarks/kernel_size.py --json     # the same as JSON

The run happens in a child process so that nothing this script imports is counted. Each
extension's size (every module of its subpackage, by the same count) is printed after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from radon.raw import analyze

#: Tool packages: they use the public API and are not what a run of the trainer needs.
TOOLS = ("sim", "bench", "demo", "cpu", "local_backend", "testing", "prometheus", "cli")
#: The extensions: what ART's trainer has no counterpart for, each a subpackage (the layers
#: contract in pyproject.toml names the same five).
EXTENSIONS = ("admission", "autotune", "executors", "resume", "watchdog")
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "art_trio"

#: The plain run, executed in a child; it prints the module files of art_trio it loaded.
PLAIN_RUN = r'''
import asyncio, json, os, sys, tempfile
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import art, trio, trio_asyncio
from art.types import TrainResult
import art_trio


class Backend:
    """ART's backend protocol as a pipeline trainer uses it: asyncio, no GPU."""

    def __init__(self):
        self.step = 0

    async def register(self, model):
        asyncio.get_running_loop()

    async def _get_step(self, model):
        asyncio.get_running_loop()
        return self.step

    def _model_inference_name(self, model, step=None):
        return f"{model.name}@{self.step if step is None else step}"

    async def _prepare_backend_for_training(self, model, config=None):
        return ("http://127.0.0.1:9/v1", "key")

    async def _delete_checkpoint_files(self, model, steps_to_keep):
        asyncio.get_running_loop()

    async def train(self, model, groups, **kwargs):
        await asyncio.sleep(0.001)
        self.step += 1
        return TrainResult(step=self.step, metrics={"loss": 0.5})


def trajectory(reward):
    return art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
        ],
        reward=reward,
        metrics={"completion_tokens": 1},
    )


async def rollout(model, scenario, config):
    await asyncio.sleep(0.001)
    return art.TrajectoryGroup([trajectory(float(i % 2)) for i in range(2)])


async def eval_fn(model, step, config):
    await asyncio.sleep(0.001)
    return [trajectory(1.0)]


async def main():
    with tempfile.TemporaryDirectory() as base:
        model = art_trio.trainable_model(
            name="plain", project="kernel-size", base_model="none", base_path=base
        )
        backend = Backend()
        await trio_asyncio.aio_as_trio(model.register)(backend)
        trainer = art_trio.PipelineTrainer(
            model, backend, rollout, iter(range(10_000)), None, eval_fn,
            num_rollout_workers=4, min_batch_size=2, max_steps_off_policy=1, max_steps=6,
            eval_every_n_steps=2, resume=False, stall_seconds=None, admission="eager",
            log_interval_seconds=0.01,
        )
        await trainer.train()
        assert trainer.statistics().steps == 6, trainer.statistics()


trio_asyncio.run(main)
print(json.dumps(sorted(
    m.__file__ for name, m in sys.modules.items()
    if (name == "art_trio" or name.startswith("art_trio.")) and getattr(m, "__file__", None)
)))
'''


def code_lines(path: Path) -> int:
    """Radon's SLOC: the module's code lines, its docstrings left out. (Not SLOC minus
    Multi: SLOC has no docstring lines to take away, so that subtracted them twice and a
    longer docstring made a module smaller.)"""
    return analyze(path.read_text()).sloc


def loaded_modules() -> list[Path]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_RUN], env=env, check=True, capture_output=True, text=True
    ).stdout
    return [Path(p) for p in json.loads(out.strip().splitlines()[-1])]


def kernel_modules(files: list[Path]) -> dict[str, int]:
    """Each loaded module that is not a tool, by its path under art_trio, with its lines."""
    sizes: dict[str, int] = {}
    for file in files:
        parts = file.parts[file.parts.index("art_trio") + 1 :]
        top = parts[0].removesuffix(".py")
        if top in TOOLS:
            continue
        sizes["/".join(parts)] = code_lines(file)
    return sizes


def extension_sizes() -> dict[str, int]:
    """Each extension's code lines: every module of its subpackage."""
    return {
        name: sum(code_lines(path) for path in sorted((PACKAGE / name).rglob("*.py")))
        for name in EXTENSIONS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    sizes = kernel_modules(loaded_modules())
    total = sum(sizes.values())
    extensions = extension_sizes()
    if args.json:
        print(json.dumps(
            {"kernel_lines": total, "modules": sizes, "extensions": extensions}, indent=2
        ))
        return
    for name, lines in sorted(sizes.items(), key=lambda item: -item[1]):
        print(f"{lines:6d}  {name}")
    print(f"{total:6d}  code lines in {len(sizes)} modules a plain run loads")
    for name, lines in extensions.items():
        print(f"{lines:6d}  the {name} extension (art_trio.{name})")


if __name__ == "__main__":
    main()
