"""A long blocking step (the real-model demo's first model load, minutes of CPU) that still
answers Ctrl-C: it runs in a thread while the event loop listens for signals.

The first SIGINT/SIGTERM says the run will stop once the step ends (a load cut short can leave
a half-written model cache behind); a second one abandons the thread at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TextIO

import anyio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A signal stopped the step; `abandoned`: a second signal left its thread running."""

    def __init__(self, signum: int, *, abandoned: bool, what: str) -> None:
        self.signum = signum
        self.abandoned = abandoned
        self.what = what
        name = signal.Signals(signum).name
        how = "abandoned" if abandoned else "stopped after"
        super().__init__(f"{name}: {how} {what}; nothing was trained")


async def run_interruptibly(
    fn: Callable[[], object],
    *,
    what: str,
    announce: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """`fn()` in a thread; raises `Interrupted` if a signal came meanwhile (see the module).

    `announce` is printed to stdout once the signals are taken over: from that line on, a
    Ctrl-C is answered."""
    out = stream if stream is not None else sys.stderr
    first: int | None = None
    abandoned = False
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        if announce is not None:
            print(announce, flush=True)
        async with anyio.create_task_group() as tg:

            async def listen() -> None:
                nonlocal first, abandoned
                async for signum in signals:
                    if first is None:
                        first = signum
                        name = signal.Signals(signum).name
                        print(
                            f"{name}: stopping once {what} ends (cutting it short can leave a "
                            f"partial file); send {name} again to abandon it now",
                            file=out,
                            flush=True,
                        )
                    else:
                        abandoned = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(listen)
            await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
            tg.cancel_scope.cancel()  # done: stop listening
    if first is not None:
        raise Interrupted(first, abandoned=abandoned, what=what)


__all__ = ["Interrupted", "run_interruptibly"]
