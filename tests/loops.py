"""A guard for tests that run asyncio HTTP clients through trio-asyncio themselves."""

from __future__ import annotations

import asyncio

import pytest


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
