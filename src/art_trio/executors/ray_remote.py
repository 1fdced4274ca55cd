"""What runs on the Ray workers and what comes back from them: the rollout actor (its cache of
functions and models, the reply `MISSING` when a restart emptied it), rollout groups pickled
by state, and a remote failure turned back into the rollout's own exception type
(`with_context`) or recognised as a lost worker (`LOST_ERRORS`). Imported through
`executors.ray`, which says what to install when Ray is missing.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import ray
import ray.exceptions as rex
from art import TrajectoryGroup

from .model_view import scenario_id

#: Errors that mean the worker (process, actor or node) running the rollout is gone.
LOST_ERRORS: tuple[type[BaseException], ...] = (
    rex.RayActorError,  # ActorDiedError, ActorUnavailableError
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
    rex.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError, ...
    rex.TaskCancelledError,  # cancelled by someone else than this executor
)

#: Models an actor keeps built (least recently used dropped first).
_MODELS_PER_ACTOR = 8

#: What an actor answers when it lacks the function or model of a call.
MISSING = "__art_trio_ray_executor_missing__"


def _rebuild(cls: type, state: Any) -> Any:
    obj: Any = object.__new__(cls)
    obj.__setstate__(state)
    return obj


class _ByState:
    """Pickles a pydantic model by class and state, never calling its `__new__`.

    ART 0.5.18's `TrajectoryGroup.__new__` requires its trajectories, so plain pickling (what
    Ray does) cannot rebuild one; the caller receives the group itself, not this wrapper.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self.obj), self.obj.__getstate__()))


class RolloutActor:
    """One Ray worker process running many rollouts on its asyncio loop."""

    def __init__(self) -> None:
        self._functions: dict[str, Callable[..., Awaitable[Any]]] = {}
        self._models: OrderedDict[str, Any] = OrderedDict()

    async def run(self, call: tuple[Any, ...]) -> Any:
        """`call` is (function key, model key, scenario, config, function, model view); the
        last two are None unless the caller thinks this actor lacks them (first use)."""
        function_key, model_key, scenario, config, function, view = call
        if function is not None:
            self._functions[function_key] = function
        if view is not None and model_key not in self._models:
            self._models[model_key] = view.build()
            while len(self._models) > _MODELS_PER_ACTOR:
                self._models.popitem(last=False)
        found = self._functions.get(function_key)
        model = self._models.get(model_key)
        if found is None or model is None:  # restarted or evicted since: ask for them again
            return MISSING
        self._models.move_to_end(model_key)
        result = await found(model, scenario, config)
        return _ByState(result) if isinstance(result, TrajectoryGroup) else result

    async def where(self) -> dict[str, Any]:
        """This actor's process id and node id (for tests and diagnostics)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


def scenario_text(scenario: Any) -> str:
    found = scenario_id(scenario)
    return "" if found is None else f" of scenario {found!r}"


def with_context(error: rex.RayTaskError, scenario: Any) -> BaseException:
    """The rollout's own exception type (Ray's dual `RayTaskError(<type>)`), its message naming
    the scenario and carrying the remote traceback."""
    header = f"rollout{scenario_text(scenario)} failed on a Ray worker:"
    cause = error.cause
    if not isinstance(cause, BaseException):
        error.add_note(header)
        return error
    # str(error) is Ray's rendering of the remote traceback (internal frames dropped); the new
    # error keeps it verbatim under the header and holds the same cause.
    annotated = rex.RayTaskError("rollout", f"{header}\n{error}", cause, proctitle="rollout")
    result: BaseException = annotated.as_instanceof_cause()
    return result
