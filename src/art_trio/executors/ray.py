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
What runs on the workers is in `ray_remote.py`, placement arithmetic in `ray_placement.py`;
this module is the pool the trainer drives (about 410 lines: one class, whose rollout path,
placement watch and actor probes share the pool's per-actor state).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

try:
    import ray
    import ray.exceptions as rex
except ModuleNotFoundError as exc:  # the extra is not installed
    raise ModuleNotFoundError(
        f"art_trio.RayRolloutExecutor needs Ray, which is not installed ({exc}): "
        "pip install 'art-trio[ray]' (on the trainer's machine and every Ray node)",
        name=exc.name,
    ) from exc

from ..messages.errors import ExecutorUnavailable, RolloutLost
from .model_view import ModelView
from .ray_placement import (
    actors_the_cluster_holds,
    describe_cluster,
    describe_options,
)
from .ray_remote import LOST_ERRORS, MISSING, RolloutActor, scenario_text, with_context

logger = logging.getLogger("art_trio")

_CACHED_KEYS = 32


class RayActorsNotPlaced(ExecutorUnavailable):
    """No actor of the pool was placed (or reachable) within `placement_timeout`: the
    cluster cannot host them as asked. Ends the run; the scenarios stay unresolved."""


class RayRolloutExecutor:
    """Runs each rollout in a pool of async Ray actors (see the module docstring).

    `RayRolloutExecutor()` connects to the cluster `ray.init()` finds (`RAY_ADDRESS`, the
    cluster started on this machine, or a new local one), or uses the one the program already
    initialised. `address` and `init_kwargs` go to `ray.init` when it is not initialised yet.
    `num_actors` defaults to as many actors as the cluster's nodes can host (one per CPU
    with the default `num_cpus=1`; with `actor_options={"num_cpus": 2}` one per two CPUs of
    a node); `actor_options` are passed to `.options()` (e.g. `num_cpus`, `resources`,
    `runtime_env`, `scheduling_strategy`). Options no node can host raise ValueError.

    Placement: rollouts go only to actors that have answered once (placed and started); an
    actor Ray cannot place (resources taken, an explicit `num_actors` beyond the cluster)
    gets none, and after `placement_timeout` seconds it is named in a warning with its
    options and the cluster's resources. If no actor at all can be reached for
    `placement_timeout` seconds (at start, or once every actor is lost), rollouts raise
    `RayActorsNotPlaced` and the run ends (its scenarios stay unresolved, rolled on resume).
    `None` waits for ever (an autoscaling cluster adding nodes). `await placed()` checks
    before training.
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
        placement_timeout: float | None = 120.0,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if num_actors is not None and num_actors < 1:
            raise ValueError("num_actors must be >= 1")
        if placement_timeout is not None and not placement_timeout > 0:
            raise ValueError("placement_timeout must be > 0 seconds, or None (wait for ever)")
        if not ray.is_initialized():
            ray.init(address=address, **dict(init_kwargs or {}))
        options: dict[str, Any] = {
            "num_cpus": 1,
            "scheduling_strategy": "SPREAD",
            "max_restarts": -1,
            "max_task_retries": 0,
        }
        options.update(actor_options or {})
        options["max_concurrency"] = max_concurrency
        self._actor_options = options
        self.placement_timeout = placement_timeout
        if num_actors is None:
            num_actors = actors_the_cluster_holds(options, asked=actor_options or {})
        actor_class: Any = ray.remote(RolloutActor)
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
        #: Actors that lost a rollout and have not answered a probe since. Probes complete on
        #: Ray's thread, hence the plain sets (single operations under the GIL).
        self._down: set[int] = set()
        self._dead: set[int] = set()
        self._probing: dict[int, float] = {}
        #: Actors that answered once (placed and started); when each was created; those
        #: named in a warning as not placed; since when no actor could be reached.
        self._ready: set[int] = set()
        self._created = [time.monotonic()] * num_actors
        self._warned: set[int] = set()
        self._unreachable_since: float | None = time.monotonic()
        for index in range(num_actors):
            self._watch(index)

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
        while index is None:  # no actor placed yet, or every one is down: wait for one
            if self._closed:
                raise RuntimeError("this RayRolloutExecutor is shut down")
            self._give_up_if_unreachable(scenario)
            await asyncio.sleep(0.1)
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
            if isinstance(result, str) and result == MISSING:
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
            raise with_context(error, scenario) from None
        except LOST_ERRORS as error:
            if isinstance(error, rex.RayActorError):
                known.clear()  # a restarted actor starts empty
                self._down.add(index)  # calls go to the other actors until it is back
            raise RolloutLost(
                f"the Ray worker running the rollout{scenario_text(scenario)} was lost: "
                f"{type(error).__name__}: {error}"
            ) from error

    # -- the rest -----------------------------------------------------------------------------

    async def placed(self) -> list[int]:
        """Wait until every actor is placed, or `placement_timeout` seconds have passed
        since it was created (the ones left are named in a warning); the placed actors'
        indices. Raises `RayActorsNotPlaced` if none is."""
        while len(self._ready) < len(self._actors):
            if self.placement_timeout is not None and all(
                i in self._ready or time.monotonic() - self._created[i] > self.placement_timeout
                for i in range(len(self._actors))
            ):
                break
            await asyncio.sleep(0.05)
        self._warn_unplaced()
        if not self._ready:
            self._unreachable_since = -math.inf
            self._give_up_if_unreachable(None)
        return sorted(self._ready)

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
        """The worker's actor; while it is unplaced or down, another live one (None if
        there is none).

        Calls made while Ray restarts an actor fail at once (`ActorUnavailableError`), and an
        actor whose node is gone may wait for a place to restart for as long as the cluster
        lacks one; a call to an actor never placed would wait for ever. Until the actor
        answers, its workers' rollouts go to the other actors.
        """
        n = len(self._actors)
        index = self._assigned.get(worker_id, worker_id % n)
        if index in self._ready and index not in self._down:
            self._unreachable_since = None
            return index
        for down in tuple(self._down):
            self._probe(down)
        if len(self._ready) < n:
            self._warn_unplaced()
        live = [i for i in range(n) if i in self._ready and i not in self._down]
        if live:
            self._unreachable_since = None
            return live[worker_id % len(live)]
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
        return None

    def _watch(self, index: int) -> None:
        """Mark actor `index` placed once it first answers (on Ray's thread)."""
        actor = self._actors[index]

        def answered(future: Any) -> None:
            if actor is self._actors[index] and future.exception() is None:
                self._ready.add(index)

        actor.where.remote().future().add_done_callback(answered)

    def _warn_unplaced(self) -> None:
        """Name, once each, the actors not placed within `placement_timeout`, and why."""
        if self.placement_timeout is None:
            return
        now = time.monotonic()
        late = [i for i in range(len(self._actors)) if i not in self._ready
                and i not in self._warned and now - self._created[i] > self.placement_timeout]
        if not late:
            return
        self._warned.update(late)
        late = [i for i in late if i not in self._ready]  # (answered meanwhile: not late)
        if not late:
            return
        logger.warning(
            "RayRolloutExecutor: actors %s of %d not placed after %g s, each asking for %s "
            "(%s); rollouts run on the placed ones (%s) and these join when Ray places them",
            late, len(self._actors), self.placement_timeout,
            describe_options(self._actor_options), describe_cluster(),
            sorted(self._ready) or "none yet",
        )

    def _give_up_if_unreachable(self, scenario: Any) -> None:
        since = self._unreachable_since
        if self.placement_timeout is None or since is None:
            return
        if time.monotonic() - since <= self.placement_timeout:
            return
        never = not self._ready and not self._down
        what = ("none of its" if never else "no live one of its") + f" {len(self._actors)} actors"
        raise RayActorsNotPlaced(
            f"RayRolloutExecutor: {what} could be reached within placement_timeout="
            f"{self.placement_timeout:g} s, so the rollout{scenario_text(scenario)} cannot "
            f"run. Each actor asks for {describe_options(self._actor_options)}; "
            f"{describe_cluster()}. Lower actor_options or num_actors, free or add resources, "
            "or raise placement_timeout. The scenarios in flight are not lost: a resumed run "
            "rolls them."
        )

    def _probe(self, index: int) -> None:
        """Ask actor `index` where it is, at most twice a second; an answer marks it up."""
        if index in self._dead:  # Ray gave up on it: a new actor takes its place
            self._dead.discard(index)
            self._actors[index] = self._actor_class.options(**self._actor_options).remote()
            self._known[index].clear()
            self._ready.discard(index)
            self._created[index] = time.monotonic()
            self._warned.discard(index)
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
                self._ready.add(index)
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
