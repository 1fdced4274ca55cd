"""Shared fixtures: a real art.TrainableModel in a tmp dir, registered with a backend double."""

from __future__ import annotations

import os

# ART fetches a price table when imported unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio
from collections.abc import Iterator
from pathlib import Path

import art
import pytest
import trio_asyncio  # noqa: F401  (patches asyncio; tests call ART through it directly too)

from art_trio.plumbing.bridge.loop import keep_asyncio_loops_outside_trio, see_trio_asyncio_loops
from art_trio.plumbing.compat import trainable_model
from tests.crash_harness import Harness
from tests.doubles import RecordingBackend

# pytest's anyio plugin imported anyio's asyncio backend before trio_asyncio patched asyncio;
# tests that use trio-asyncio without the trainer need the same repair open_bridge() makes.
see_trio_asyncio_loops()
# And asyncio outside trio gets asyncio's own loops from the first test on, as a program does
# after art_trio's first trio run: tests under asyncio run alike whatever ran before them.
keep_asyncio_loops_outside_trio()


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
def model(tmp_path: Path, backend: RecordingBackend) -> art.TrainableModel:
    model = trainable_model(
        name="m", project="p", base_model="test-base", base_path=str(tmp_path / ".art")
    )
    # register() is ART's asyncio code calling the asyncio-only double: run it on asyncio.
    asyncio.run(model.register(backend))
    return model


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """The kill -9 tests' crash harness; its children are killed whatever the test does."""
    h = Harness(tmp_path / "harness-stderr.txt")
    try:
        yield h
    finally:
        h.close()
