"""Rollouts on a Ray cluster: a pool of async Ray actors running the user's asyncio rollout_fn.

Design. Each actor is one Ray worker process with its own asyncio loop; it runs up to
`max_concurrency` rollouts at once, the way the trainer's own process would (rollouts wait
on inference, they do not compute). Remote *tasks* would cost a worker process and a CPU slot
per running rollout: a thousand concurrent rollouts would be a thousand processes.

- The trainer's rollout workers are spread over the actors (sticky: worker `i` always uses
  the same actor), and actors over nodes (`SPREAD`, one CPU each by default).
- The model travels as a `ModelView` (fields, config, inference name), sent to an actor the
  first time it needs that version and rebuilt there once, so `model.openai_client()` is shared
  by the actor's rollouts as the trainer's one is. The rollout function (by reference if it is
  importable on the workers, else by value: closures work) is sent once per actor too. Per
  call only the keys, the scenario and the config travel; an actor that lost its cache
  (restarted) answers "missing" and gets them again.
- Cancelling the asyncio task awaiting `run` cancels the actor task (an `asyncio.CancelledError`
  in the rollout on its node, so its `finally` runs there), waits up to `cancel_timeout`
  seconds for the node to confirm, and re-raises `CancelledError`.
- A dead worker process, actor or node raises `RolloutLost`; Ray restarts the actor
  (`max_restarts=-1`) and never retries the task (`max_task_retries=0`): the trainer decides.
- A failing rollout raises its own exception type (Ray's `as_instanceof_cause`), whose message
  carries the scenario's id and the remote traceback.

Importing `art_trio` does not import this module (nor ray); `art_trio.RayRolloutExecutor` does.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import ray
import ray.exceptions as rex
from art import TrajectoryGroup

from .executor import ModelView, RolloutLost, scenario_id

#: Errors that mean the worker (process, actor or node) running the rollout is gone.
LOST_ERRORS: tuple[type[BaseException], ...] = (
    rex.RayActorError,  # ActorDiedError, ActorUnavailableError
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
    rex.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError, ...
    rex.TaskCancelledError,  # cancelled by someone else than this executor
)

_MODELS_PER_ACTOR = 8
_CACHED_KEYS = 32


#: What an actor answers when it lacks the function or model of a call.
_MISSING = "__art_trio_ray_executor_missing__"


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


class _RolloutActor:
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
            return _MISSING
        self._models.move_to_end(model_key)
        result = await found(model, scenario, config)
        return _ByState(result) if isinstance(result, TrajectoryGroup) else result

    async def where(self) -> dict[str, Any]:
        """This actor's process id and node id (for tests and diagnostics)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


class RayRolloutExecutor:
    """Runs each rollout in a pool of async Ray actors (see the module docstring).

    `RayRolloutExecutor()` connects to the cluster `ray.init()` finds (`RAY_ADDRESS`, the
    cluster started on this machine, or a new local one), or uses the one the program already
    initialised. `address` and `init_kwargs` go to `ray.init` when it is not initialised yet.
    `num_actors` defaults to the cluster's CPU count; `actor_options` are passed to
    `.options()` (e.g. `num_cpus`, `resources`, `runtime_env`, `scheduling_strategy`).
    """

    def __init__(
        self,
        *,
        num_actors: int | None = None,
        max_concurrency: int = 1000,
        actor_options: Mapping[str, Any] | None = None,
        cancel_timeout: float = 2.0,
        address: str | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if num_actors is not None and num_actors < 1:
            raise ValueError("num_actors must be >= 1")
        if not ray.is_initialized():
            ray.init(address=address, **dict(init_kwargs or {}))
        if num_actors is None:
            num_actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
        options: dict[str, Any] = {
            "num_cpus": 1,
            "scheduling_strategy": "SPREAD",
            "max_restarts": -1,
            "max_task_retries": 0,
        }
        options.update(actor_options or {})
        options["max_concurrency"] = max_concurrency
        actor_class: Any = ray.remote(_RolloutActor)
        self._actors: list[Any] = [
            actor_class.options(**options).remote() for _ in range(num_actors)
        ]
        self._max_concurrency = max_concurrency
        self.cancel_timeout = cancel_timeout
        self._assigned: dict[int, int] = {}
        # id(function) -> (function, key): the function kept alive so its id is not reused;
        # model fingerprint -> (key, view); per actor, the keys it was sent.
        self._functions: OrderedDict[int, tuple[Any, str]] = OrderedDict()
        self._models: OrderedDict[str, tuple[str, ModelView]] = OrderedDict()
        self._known: list[set[str]] = [set() for _ in range(num_actors)]
        self._closed = False
        self._actor_class = actor_class
        self._actor_options = options
        #: Actors that lost a rollout and have not answered a probe since. Probes complete on
        #: Ray's thread, hence the plain sets (single operations under the GIL).
        self._down: set[int] = set()
        self._dead: set[int] = set()
        self._probing: dict[int, float] = {}

    # -- the RolloutExecutor protocol ---------------------------------------------------------

    @property
    def max_workers(self) -> int | None:
        return len(self._actors) * self._max_concurrency

    def set_target(self, target_workers: int) -> None:
        if target_workers < 1:
            raise ValueError("target_workers must be >= 1")
        limit = self.max_workers
        if limit is not None and target_workers > limit:
            raise ValueError(
                f"{target_workers} rollout workers exceed this Ray pool's {limit} "
                f"({len(self._actors)} actors x max_concurrency {self._max_concurrency})"
            )

    def set_workers(self, worker_ids: tuple[int, ...]) -> None:
        """Spread the workers over the actors evenly; a worker keeps its actor if it can."""
        n = len(self._actors)
        workers = sorted(set(worker_ids))
        per_actor = -(-len(workers) // n) if workers else 0
        load = [0] * n
        kept: dict[int, int] = {}
        for worker in workers:
            actor = self._assigned.get(worker)
            if actor is not None and load[actor] < per_actor:
                kept[worker] = actor
                load[actor] += 1
        for worker in workers:
            if worker not in kept:
                actor = min(range(n), key=lambda i: (load[i], i))
                kept[worker] = actor
                load[actor] += 1
        self._assigned = kept

    async def run(
        self,
        worker_id: int,
        rollout_fn: Callable[..., Awaitable[Any]],
        model: Any,
        scenario: Any,
        config: Any,
    ) -> Any:
        if self._closed:
            raise RuntimeError("this RayRolloutExecutor is shut down")
        index = self._actor_for(worker_id)
        while index is None:  # every actor is down: wait for one to come back
            if self._closed:
                raise RuntimeError("this RayRolloutExecutor is shut down")
            await asyncio.sleep(0.2)
            index = self._actor_for(worker_id)
        actor = self._actors[index]
        function_key = self._function_key(rollout_fn)
        model_key, view = self._model_view(model)
        known = self._known[index]
        ship = function_key not in known or model_key not in known
        ref = actor.run.remote(
            (
                function_key,
                model_key,
                scenario,
                config,
                rollout_fn if ship else None,
                view if ship else None,
            )
        )
        try:
            result = await ref
            if isinstance(result, str) and result == _MISSING:
                call = (function_key, model_key, scenario, config, rollout_fn, view)
                ref = actor.run.remote(call)
                result = await ref
            if len(known) > 4 * _CACHED_KEYS:
                known.clear()
            known.update((function_key, model_key))
            return result
        except asyncio.CancelledError:
            await self._cancel(ref)
            raise
        except rex.RayTaskError as error:
            raise _with_context(error, scenario) from None
        except LOST_ERRORS as error:
            if isinstance(error, rex.RayActorError):
                known.clear()  # a restarted actor starts empty
                self._down.add(index)  # calls go to the other actors until it is back
            raise RolloutLost(
                f"the Ray worker running the rollout{_scenario_text(scenario)} was lost: "
                f"{type(error).__name__}: {error}"
            ) from error

    # -- the rest -----------------------------------------------------------------------------

    async def where(self) -> list[dict[str, Any]]:
        """Each actor's pid and node id; waits until every actor is up."""
        return list(await asyncio.gather(*(actor.where.remote() for actor in self._actors)))

    def shutdown(self) -> None:
        """Kill the actors: rollouts still running end at once, without their `finally`.
        Cancel them first for a clean end. Leaves Ray itself initialised."""
        self._closed = True
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._functions.clear()
        self._models.clear()

    def __enter__(self) -> RayRolloutExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _actor_for(self, worker_id: int) -> int | None:
        """The worker's actor; while it is down, another live one (None if all are down).

        Calls made while Ray restarts an actor fail at once (`ActorUnavailableError`), and an
        actor whose node is gone may wait for a place to restart for as long as the cluster
        lacks one. Until a probe answers, its workers' rollouts go to the other actors.
        """
        n = len(self._actors)
        index = self._assigned.get(worker_id, worker_id % n)
        if index not in self._down:
            return index
        for down in tuple(self._down):
            self._probe(down)
        live = [i for i in range(n) if i not in self._down]
        return live[worker_id % len(live)] if live else None

    def _probe(self, index: int) -> None:
        """Ask actor `index` where it is, at most twice a second; an answer marks it up."""
        if index in self._dead:  # Ray gave up on it: a new actor takes its place
            self._dead.discard(index)
            self._actors[index] = self._actor_class.options(**self._actor_options).remote()
            self._known[index].clear()
        now = time.monotonic()
        if now - self._probing.get(index, -1.0) < 0.5:
            return
        self._probing[index] = now
        actor = self._actors[index]

        def probed(future: Any) -> None:
            if actor is not self._actors[index]:
                return
            error = future.exception()
            if error is None:
                self._down.discard(index)
            elif isinstance(error, rex.ActorDiedError):
                self._dead.add(index)

        actor.where.remote().future().add_done_callback(probed)

    async def _cancel(self, ref: Any) -> None:
        """Cancel the actor task and wait (bounded) until its node reports it ended."""
        ray.cancel(ref)
        done = asyncio.wrap_future(ref.future())
        try:
            await asyncio.wait({done}, timeout=self.cancel_timeout)
        except asyncio.CancelledError:
            pass  # cancelled again while waiting: stop waiting, the caller re-raises
        if done.done() and not done.cancelled():
            done.exception()  # retrieved, so asyncio does not log it
        else:
            done.cancel()

    def _function_key(self, function: Any) -> str:
        entry = self._functions.get(id(function))
        if entry is None or entry[0] is not function:
            entry = (function, uuid.uuid4().hex)
            self._functions[id(function)] = entry
            while len(self._functions) > _CACHED_KEYS:
                self._functions.popitem(last=False)
        return entry[1]

    def _model_view(self, model: Any) -> tuple[str, ModelView]:
        view = ModelView.of(model)
        fingerprint = view.fingerprint()
        entry = self._models.get(fingerprint)
        if entry is None:
            # The entry keeps the view, so the config whose id is in the fingerprint, alive.
            entry = self._models[fingerprint] = (uuid.uuid4().hex, view)
            while len(self._models) > _CACHED_KEYS:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(fingerprint)
        return entry


def _scenario_text(scenario: Any) -> str:
    found = scenario_id(scenario)
    return "" if found is None else f" of scenario {found!r}"


def _with_context(error: rex.RayTaskError, scenario: Any) -> BaseException:
    """The rollout's own exception type (Ray's dual `RayTaskError(<type>)`), its message naming
    the scenario and carrying the remote traceback."""
    header = f"rollout{_scenario_text(scenario)} failed on a Ray worker:"
    cause = error.cause
    if not isinstance(cause, BaseException):
        error.add_note(header)
        return error
    # str(error) is Ray's rendering of the remote traceback (internal frames dropped); the new
    # error keeps it verbatim under the header and holds the same cause.
    annotated = rex.RayTaskError("rollout", f"{header}\n{error}", cause, proctitle="rollout")
    result: BaseException = annotated.as_instanceof_cause()
    return result


__all__ = ["LOST_ERRORS", "RayRolloutExecutor"]
