"""Crash harness: art_trio work in a child process that a test kills with SIGKILL at random.

Run from the repository root (`python -m tests.crash_harness ...`):

    serve
        A fork server. Importing ART costs seconds, so it imports everything once, then
        forks one child per command read from stdin, replying `@ child <pid>` and, when the
        child ends, `@ exit <pid> <code>` (negative code: killed by that signal).
        Commands (one per line): `train <dir> <total_steps> <seed> [<fork>]`, `write-loop
        <dir>`, `quit`. Children inherit stdout; the lines meant for the test start with "@ ".
    train <dir> <total_steps> <seed>
        One training run in this process, resuming from <dir>: PipelineTrainer under trio with
        a backend double that appends every trained step (its scenario ids) to
        <dir>/trained.log and fsyncs it BEFORE returning from train; its step is the number of
        lines there, so it survives the kill. Rollouts sleep a few random milliseconds (asyncio
        or anyio, by seed). Runs until the backend reaches <total_steps>. Prints
        `@ started <step>`, `@ step <n>` after each durable step, `@ done <step> <counters>`.
        With <fork> (`mp-fork`, `os-fork` or `subprocess`), the first rollout starts a helper
        that sleeps for 10 minutes (multiprocessing's "fork" context, a bare os.fork, or
        `sleep` through subprocess with close_fds=False) and prints `@ helper <pid>`.
    write-loop <dir>
        Persists ever larger states with a StateStore, printing `@ ack <n>` after each write
        returned (state n has training_step n and the ledger `expected_ledger(n)`, so a
        reader can tell a whole state from a mix of two).

By construction the training runs never discard a group (rewards always differ, and
max_steps_off_policy = total_steps means nothing goes stale), so every scenario index below
the final watermark must be in trained.log.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio
import dataclasses
import functools
import json
import queue
import random
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import anyio
import art
import trio
from art.types import TrainResult

from art_trio import PipelineTrainer, trio_native
from art_trio.plumbing.bridge.calls import is_native
from art_trio.plumbing.compat import trainable_model
from art_trio.resume.scenarios import ScenarioLedger
from art_trio.resume.state import PipelineState
from art_trio.resume.store import StateStore
from tests.doubles import RecordingBackend, scenarios, trajectory

REPO = Path(__file__).resolve().parents[1]
TRAINED_LOG = "trained.log"
SCENARIO_COUNT = 100_000


def emit(line: str) -> None:
    """A protocol line for the test (flushed at once: the process may die any moment)."""
    sys.stdout.write(f"@ {line}\n")
    sys.stdout.flush()


def read_trained(path: Path) -> list[dict[str, Any]]:
    """The durable train log: one JSON line {"step": n, "ids": [...]} per trained step.

    A line is appended with a single write() call, which a kill cannot split; an unterminated
    last line would still be ignored (and cut off before the next append).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


class DurableBackend(RecordingBackend):
    """RecordingBackend whose trained steps survive SIGKILL (append + fsync before return)."""

    def __init__(self, log_path: Path, rng: random.Random) -> None:
        super().__init__(write_checkpoints=False)
        self.log_path = log_path
        self.rng = rng
        records = read_trained(log_path)
        self.step = len(records)
        self._truncate_torn_tail(records)

    def _truncate_torn_tail(self, records: list[dict[str, Any]]) -> None:
        if not self.log_path.exists():
            return
        whole = "".join(json.dumps(r) + "\n" for r in records).encode()
        if self.log_path.stat().st_size != len(whole):
            self.log_path.write_bytes(whole)

    async def train(
        self, model: Any, trajectory_groups: Any, **kwargs: Any
    ) -> TrainResult:
        asyncio.get_running_loop()  # asyncio-only, as real backends are
        groups = list(trajectory_groups)
        await asyncio.sleep(self.rng.uniform(0.0, 0.004))
        step = self.step + 1
        record = {"step": step, "ids": [g.metadata["scenario_id"] for g in groups]}
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.step = step
        emit(f"step {step}")
        # A kill here leaves a step the backend did but the trainer never heard of.
        await asyncio.sleep(self.rng.uniform(0.0, 0.004))
        return TrainResult(step=step, metrics={"loss": 0.0})


def _group(scenario: dict[str, Any]) -> art.TrajectoryGroup:
    # Rewards always differ: never zero variance, so never discarded.
    return art.TrajectoryGroup([trajectory(0.0), trajectory(0.5), trajectory(1.0)])


def start_helper(kind: str) -> int:
    """A helper process a rollout forks, sleeping far longer than any test (see `serve`)."""
    if kind == "mp-fork":
        import multiprocessing
        import time

        process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        process.start()
        assert process.pid is not None
        return process.pid
    if kind == "os-fork":
        pid = os.fork()
        if pid == 0:
            import time

            try:
                time.sleep(600)
            finally:
                os._exit(0)
        return pid
    if kind == "subprocess":
        return subprocess.Popen(["sleep", "600"], close_fds=False).pid
    raise SystemExit(f"unknown helper kind {kind!r}")


async def run_training(directory: Path, total_steps: int, seed: int, fork: str = "") -> None:
    rng = random.Random(seed)
    backend = DurableBackend(directory / TRAINED_LOG, rng)
    model: art.TrainableModel[Any, Any] = trainable_model(
        name="crash", project="p", base_model="test-base", base_path=str(directory / ".art")
    )
    await trio_asyncio_call(model.register, backend)
    remaining = total_steps - backend.step
    if remaining <= 0:
        emit(f"done {backend.step} {{}}")
        return

    if seed % 2:

        async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
            asyncio.get_running_loop()
            await asyncio.sleep(rng.uniform(0.0, 0.01))
            return _group(scenario)

    else:

        @trio_native
        async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
            await anyio.sleep(rng.uniform(0.0, 0.01))
            return _group(scenario)

    if fork:
        plain_rollout = rollout

        async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
            nonlocal fork
            if fork:
                kind, fork = fork, ""
                emit(f"helper {start_helper(kind)}")
            return await plain_rollout(model, scenario, config)

        if is_native(plain_rollout):
            rollout = trio_native(rollout)

    trainer = PipelineTrainer(
        model,
        backend,
        rollout,
        scenarios(SCENARIO_COUNT),
        None,
        num_rollout_workers=6,
        min_batch_size=2,
        max_batch_size=4,
        max_steps_off_policy=total_steps,
        max_steps=remaining,
        eval_step_0=False,
        log_interval_seconds=3600.0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        emit(f"started {backend.step}")
    counters = dataclasses.asdict(trainer.last_counters) if trainer.last_counters else {}
    counters.pop("staleness", None)
    emit(f"done {backend.step} {json.dumps(counters)}")


async def trio_asyncio_call(fn: Any, *args: Any) -> Any:
    import trio_asyncio

    async with trio_asyncio.open_loop():
        return await trio_asyncio.aio_as_trio(fn)(*args)


def expected_ledger(n: int) -> ScenarioLedger:
    """The ledger the write loop has persisted after its n-th write."""
    ledger = ScenarioLedger()
    for i in range(1, n + 1):
        _resolve_for_write(ledger, i)
    return ledger


def _resolve_for_write(ledger: ScenarioLedger, n: int) -> None:
    # Advances the watermark, and adds 100 far indices so that states (and the time a write
    # takes, the window a kill must not tear) keep growing.
    ledger.resolve(n - 1)
    ledger.resolve(3 * (n - 1))
    ledger.resolve_all(range(10**6 + 200 * n, 10**6 + 200 * (n + 1), 2))


def write_loop(directory: Path) -> None:
    """Persist ever larger states: the n-th has training_step n and `expected_ledger(n)`.

    Each write goes through the store's per-step path (`append`, a journal record) and every
    4th through a full snapshot (`write`), as a run does.
    """
    store = StateStore(directory)
    state = store.read() or PipelineState()
    first = (state.training_step or 0) + 1
    # Bounded, so that a loop whose test died cannot run forever.
    for n in range(first, first + 20_000):
        _resolve_for_write(state.ledger, n)
        state.training_step = n
        if n % 4 == 0:
            store.write(state)
        else:
            store.append(state)
        emit(f"ack {n}")


def run_command(args: list[str]) -> None:
    if args[0] == "train":
        directory, total, seed = Path(args[1]), int(args[2]), int(args[3])
        fork = args[4] if len(args) > 4 else ""
        directory.mkdir(parents=True, exist_ok=True)
        trio.run(run_training, directory, total, seed, fork)
    elif args[0] == "write-loop":
        write_loop(Path(args[1]))
    else:
        raise SystemExit(f"unknown command {args!r}")


def serve() -> None:
    emit("ready")
    for line in sys.stdin:
        args = line.split()
        if not args:
            continue
        if args[0] == "quit":
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # The child waits for `go` so that `@ child <pid>` precedes everything it prints.
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(go_write)
                os.read(go_read, 1)
                os.close(go_read)
                run_command(args)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(go_read)
        emit(f"child {pid}")
        os.write(go_write, b"g")
        os.close(go_write)
        _, status = os.waitpid(pid, 0)
        emit(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


# -- the test's side -------------------------------------------------------------------------

class Harness:
    """Drives `python -m tests.crash_harness serve`: start children, read their lines, kill."""

    def __init__(self, stderr_path: Path) -> None:
        self._stderr = stderr_path.open("wb")
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_harness", "serve"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        #: Children started and not yet seen to exit (killed on close, so none outlives a test).
        self.running: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next_line() == "ready"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@ "):
                self.lines.put(line[2:].rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float = 60.0) -> str:
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise AssertionError("the crash harness exited; see its stderr")
        return line

    def start(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.next_line()
        word, pid = line.split()
        assert word == "child", line
        self.running.add(int(pid))
        return int(pid)

    def close(self) -> None:
        for pid in self.running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


class Child:
    """One child of the harness, with the lines it printed so far."""

    def __init__(self, harness: Harness, command: str) -> None:
        self.harness = harness
        self.pid = harness.start(command)
        self.lines: list[str] = []
        self.exit_code: int | None = None

    def wait_for(self, prefix: str, count: int = 1) -> bool:
        """Read lines until `count` more lines starting with `prefix`; False if it exited."""
        seen = 0
        while seen < count:
            if self.exit_code is not None:
                return False
            line = self.harness.next_line()
            if line.startswith("exit "):
                _, pid, code = line.split()
                assert int(pid) == self.pid
                self.exit_code = int(code)
                self.harness.running.discard(self.pid)
                return False
            self.lines.append(line)
            seen += line.startswith(prefix)
        return True

    def kill(self) -> int:
        """SIGKILL it unless it already ended; return its exit code (-9 if killed)."""
        if self.exit_code is None and not any(line.startswith("done") for line in self.lines):
            os.kill(self.pid, signal.SIGKILL)
        while self.exit_code is None:
            self.wait_for("exit")
        return self.exit_code


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve()
    else:
        run_command(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
