"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on:
the only package that knows trio-asyncio. `calls.py` is the bridge itself (what crosses, how
cancellation and errors come back; its docstring tells), `loop.py` tunes the trio-asyncio
loop it opens.
"""

from __future__ import annotations

from ...messages.errors import AsyncioTaskCancelled, CallbackNotAwaitable
from .calls import (
    Bridge,
    await_callback,
    call_asyncio_from_trio,
    is_native,
    open_bridge,
    trio_native,
)

__all__ = [
    "AsyncioTaskCancelled",
    "Bridge",
    "CallbackNotAwaitable",
    "await_callback",
    "call_asyncio_from_trio",
    "is_native",
    "open_bridge",
    "trio_native",
]
