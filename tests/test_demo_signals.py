"""Ctrl-C on `art-trio demo`, as a shell sends it: a clean stop, the summary, exit status 130
(128 + SIGINT, what a shell expects of an interrupted program), and the run resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="sends SIGINT to a child process (POSIX only)"
)


def demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.getenv("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("LITELLM_LOCAL_MODEL_COST_MAP", None)  # art_trio sets it itself
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "art_trio.demo",
            "--output-dir",
            str(tmp_path),
            "--no-plot",
            "--name",
            "ctrl-c",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_ctrl_c_stops_cleanly_exits_130_and_the_run_resumes(tmp_path: Path) -> None:
    child = demo(tmp_path, "--steps", "100000")
    assert child.stdout is not None
    seen = []
    for line in child.stdout:  # the trainer is running once it prints a [status] line
        seen.append(line)
        if line.startswith("[status]"):
            break
    else:
        pytest.fail("the demo ended before training:\n" + "".join(seen) + child.stderr.read())
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    out = "".join(seen) + out
    assert child.returncode == 130, out + err
    assert "Stopped by SIGINT after" in out and "--name ctrl-c to resume" in out, out
    assert "Traceback" not in err, err
    # A failed download of LiteLLM's price table is not a newcomer's concern: art_trio keeps
    # ART's import offline without being told.
    assert "LiteLLM" not in err and "model_prices" not in err, err

    again = demo(tmp_path, "--steps", "2")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out + err
    assert "Training 'ctrl-c': 2 steps from step " in out and "Done: 2 steps" in out, out


async def test_an_error_inside_the_backend_block_reaches_the_caller_as_itself(
    tmp_path: Path,
) -> None:
    """A misspelt trainer keyword inside `async with CpuBackend()`: the caller gets the
    TypeError with its "did you mean", not a 31-line ExceptionGroup from the backend's
    server task group."""
    from art_trio import PipelineTrainer, trainable_model
    from art_trio.demo import CpuBackend, TaskConfig, eval_fn, rollout, scenarios

    model = trainable_model(
        name="bad-keyword", project="p", base_model="cpu-demo", base_path=str(tmp_path)
    )
    with pytest.raises(TypeError, match="did you mean 'num_rollout_workers'") as raised:
        async with CpuBackend(seed=0) as backend:
            await model.register(backend)
            PipelineTrainer(
                model, backend, rollout, scenarios(0), TaskConfig(), eval_fn,
                num_rollout_worker=2,
            )  # fmt: skip
    assert type(raised.value) is TypeError


def test_ctrl_c_stops_a_trainer_and_it_says_which_signal(tmp_path: Path) -> None:
    """`trainer.stop_signal`: what a program checks to exit 130 after a clean Ctrl-C stop."""
    import trio

    from art_trio import PipelineTrainer, StepTrained, trainable_model
    from art_trio.demo import CpuBackend, TaskConfig, eval_fn, rollout, scenarios

    async def main() -> PipelineTrainer[Any, Any]:
        model = trainable_model(name="m", project="p", base_model="cpu-demo",
                                base_path=str(tmp_path))  # fmt: skip
        async with CpuBackend(seed=0) as backend:
            await model.register(backend)
            trainer = PipelineTrainer(
                model, backend, rollout, scenarios(0), TaskConfig(), eval_fn,
                num_rollout_workers=2, min_batch_size=2, max_steps=1000,
            )  # fmt: skip
            trainer.add_observer(
                lambda e: isinstance(e, StepTrained) and signal.raise_signal(signal.SIGINT)
            )
            assert trainer.stop_signal is None
            await trainer.train()  # handle_signals=True: a first SIGINT is a clean stop
        return trainer

    trainer = trio.run(main)
    assert trainer.stop_signal is signal.SIGINT
    assert 0 < trainer.statistics().steps < 1000


class _Heard:
    """A stream that tells a waiting thread the message was printed."""

    def __init__(self) -> None:
        import threading

        self.text = ""
        self.printed = threading.Event()

    def write(self, text: str) -> int:
        self.text += text
        self.printed.set()
        return len(text)

    def flush(self) -> None:
        pass


def test_a_blocking_load_answers_ctrl_c_and_a_second_abandons_it() -> None:
    """Issue 32 item 9: two Ctrl-C during the real model's first load were honoured only after
    the load, then a 49-line traceback. Now the first says the run stops after the load, the
    second abandons the load's thread at once."""
    import threading

    import trio

    from art_trio.demo.interrupt import Interrupted, run_interruptibly

    heard, release = _Heard(), threading.Event()

    def load() -> None:  # a load that would take minutes
        os.kill(os.getpid(), signal.SIGINT)
        assert heard.printed.wait(30)
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(60)

    try:
        with pytest.raises(Interrupted) as stopped:
            trio.run(lambda: run_interruptibly(load, what="the model load", stream=heard))
    finally:
        release.set()
    assert stopped.value.abandoned and stopped.value.signum == signal.SIGINT
    assert str(stopped.value) == "SIGINT: abandoned the model load; nothing was trained"
    assert "send SIGINT again to abandon it now" in heard.text


def test_one_ctrl_c_lets_the_load_finish_then_stops() -> None:
    import trio

    from art_trio.demo.interrupt import Interrupted, run_interruptibly

    heard, finished = _Heard(), []

    def load() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        assert heard.printed.wait(30)
        finished.append(True)

    with pytest.raises(Interrupted) as stopped:
        trio.run(lambda: run_interruptibly(load, what="the model load", stream=heard))
    assert finished and not stopped.value.abandoned
    assert str(stopped.value) == "SIGINT: stopped after the model load; nothing was trained"
