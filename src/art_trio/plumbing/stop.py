"""How a run stops: the one protocol every stage follows, shared by all of them.

`request_stop` is set once: by `trainer.request_stop()`, a signal, or the training stage
when it ends on its own. `graceful` decides whether in-flight rollouts and a running eval get
`shutdown_grace_seconds` before their scopes are cancelled (the control stage enforces it).
Stages register what a stop must interrupt at once (a batch being collected, a scenario
source being read) with `on_stop`, instead of the stop reaching into their state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio


class StopControl:
    def __init__(self, grace_seconds: float | None) -> None:
        self._grace = grace_seconds
        self.requested = anyio.Event()
        self.graceful = True
        #: Set when every rollout worker has ended; when no eval is running.
        self.rollouts_done = anyio.Event()
        self.eval_idle = anyio.Event()
        self.eval_idle.set()
        #: Set when the rollout, training and eval stages have all ended.
        self.finished = anyio.Event()
        #: Cancelled when the grace period ends (or at once when the run ends on its own).
        self.rollout_scope = anyio.CancelScope()
        #: The running eval's scope (None while none runs): see `eval_begins`.
        self.eval_scope: anyio.CancelScope | None = None
        #: Every stage's scope (the trainer runs the stages in it): cancelled by a forced stop.
        self.run_scope = anyio.CancelScope()
        #: The signal (SIGINT, SIGTERM) that asked for the stop, if one did.
        self.signal: int | None = None
        self._on_stop: list[Callable[[], None]] = []
        self._stages_left = {"rollout", "training", "eval"}

    @property
    def stopping(self) -> bool:
        return self.requested.is_set()

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the stop is requested (at once if it already was).

        Returns a function that unregisters it (call it when what it stops is over)."""
        if self.stopping:
            callback()
            return lambda: None
        self._on_stop.append(callback)

        def remove() -> None:
            if callback in self._on_stop:
                self._on_stop.remove(callback)

        return remove

    def request(self, *, graceful: bool = True) -> None:
        """Stop taking scenarios; let in-flight work finish within the grace period."""
        if not self.stopping:
            self.graceful = graceful
            self.requested.set()
        callbacks, self._on_stop = self._on_stop, []
        for callback in callbacks:
            callback()

    def cancel_everything(self) -> None:
        """The second signal: cancel every stage now (state is still persisted)."""
        self.request(graceful=False)
        self.run_scope.cancel()

    def eval_begins(self) -> anyio.CancelScope:
        """An eval starts: the scope to run it in (the grace period's end cancels it)."""
        self.eval_idle = anyio.Event()
        self.eval_scope = anyio.CancelScope()
        return self.eval_scope

    def eval_ended(self) -> None:
        """The eval that began last has ended, its checkpoint released."""
        self.eval_scope = None
        self.eval_idle.set()

    @property
    def grace_seconds(self) -> float:
        if not self.graceful:
            return 0.0
        return math.inf if self._grace is None else self._grace

    def stage_done(self, name: str) -> None:
        self._stages_left.discard(name)
        if not self._stages_left:
            self.finished.set()
