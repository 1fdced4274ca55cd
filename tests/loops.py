"""Running a trainer under trio or asyncio from a test: a run with a deadline, the state it
left, and a guard for tests that run asyncio HTTP clients through trio-asyncio themselves."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio.resume.files import SIDECAR_FILE


def run_with_deadline(
    how: str, main: Callable[[], Awaitable[Any]], seconds: float
) -> BaseException | None:
    """Run `main` under trio or anyio's asyncio in a daemon thread; what it raised, if
    anything. A run still going after `seconds` fails the test instead of hanging it (the
    thread is a daemon: a loop that cannot be ended stays behind, which is the fault tested
    for)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            if how == "trio":
                trio.run(main)
            else:
                anyio.run(main, backend="asyncio")
        except BaseException as exc:  # noqa: BLE001  (the test inspects it)
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the run under {how} did not return within {seconds:g} s: it hangs")
    return outcome[0]


def sidecar(model: art.TrainableModel) -> dict[str, Any]:
    """The run state a trainer left in the model's directory."""
    data = json.loads((Path(model._get_output_dir()) / SIDECAR_FILE).read_text())
    assert isinstance(data, dict)
    return data


def require_trio_asyncio_patched_anyio() -> None:
    """Fail fast unless anyio's asyncio backend sees trio-asyncio's `get_running_loop`.

    httpx runs on anyio. anyio's asyncio backend binds `asyncio.get_running_loop` when first
    imported; imported before trio_asyncio (pytest's anyio plugin does that) it cannot see
    trio-asyncio's loop, every request fails to connect, and a trainer would wait forever.
    tests/conftest.py makes the repair `open_bridge()` makes; this guard catches a regression.
    """
    import anyio._backends._asyncio as anyio_asyncio

    if anyio_asyncio.get_running_loop is not asyncio.get_running_loop:
        pytest.fail(
            "anyio's asyncio backend holds the unpatched asyncio.get_running_loop: "
            "art_trio.plumbing.bridge.loop.see_trio_asyncio_loops() must run after trio_asyncio "
            "is imported (tests/conftest.py does it)"
        )
