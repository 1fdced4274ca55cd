"""Where Ray can place the rollout actors: the resources one actor asks for, how many actors
the live nodes hold, and the options and cluster described for a message."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import ray

logger = logging.getLogger("art_trio")


def actor_demand(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources one actor asks Ray for (positive amounts only)."""
    demand = {"CPU": float(options.get("num_cpus") or 0),
              "GPU": float(options.get("num_gpus") or 0),
              "memory": float(options.get("memory") or 0)}
    demand.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    return {k: v for k, v in demand.items() if v > 0}


def actors_that_fit(options: Mapping[str, Any], nodes: list[dict[str, Any]]) -> int | None:
    """How many actors asking `options`' resources the live nodes hold when empty, node by
    node (an actor lives on one node); None when an actor asks for nothing."""
    demand = actor_demand(options)
    if not demand:
        return None
    total = 0
    for node in nodes:
        if not node.get("Alive", True):
            continue
        held = node.get("Resources") or {}
        total += min(int(float(held.get(k, 0)) / v + 1e-9) for k, v in demand.items())
    return total




def _ray_internal(key: str) -> bool:
    # node:<ip>, accelerator_type:..., object_store_memory, memory: noise in a message.
    return ":" in key or key in ("object_store_memory", "memory")


def _brief(resources: Any) -> str:
    if isinstance(resources, list):
        return "[" + ", ".join(_brief(r) for r in resources) + "]"
    shown = {k: (int(v) if float(v).is_integer() else round(v, 2))
             for k, v in sorted(resources.items()) if not _ray_internal(k)}
    return str(shown)




def describe_options(options: Mapping[str, Any]) -> str:
    """The resource options an actor asks for, as a message names them."""
    asked = {k: options[k] for k in
             ("num_cpus", "num_gpus", "memory", "resources", "scheduling_strategy",
              "placement_group") if options.get(k) is not None}
    return f"actor_options {asked}"


def describe_cluster() -> str:
    """The live nodes' resources, the cluster's total and what is free now, for a message."""
    try:
        nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
        available = ray.available_resources()  # omits what is all taken
        free = {k: available.get(k, 0.0) for k in total}
    except Exception as exc:  # a lost connection: say so rather than fail the message
        return f"the cluster's resources are unknown ({exc!r})"
    shown = ("CPU", "GPU")
    per_node = [{k: v for k, v in node.items() if k in shown or not _ray_internal(k)}
                for node in nodes]
    return (f"the cluster has {len(nodes)} live nodes holding {_brief(per_node)}, "
            f"{_brief(total)} in total, {_brief(free)} free now")


def actors_the_cluster_holds(options: Mapping[str, Any], *, asked: Mapping[str, Any]) -> int:
    """The pool's default size: as many actors asking `options` as the live nodes hold (one
    per CPU when an actor asks for nothing but the default CPU). ValueError when no node can
    host one; logged when the user's own `asked` options set the size."""
    fit = actors_that_fit(options, ray.nodes())
    if fit == 0:
        raise ValueError(
            f"no node of this Ray cluster can host a rollout actor asking for "
            f"{describe_options(options)}: {describe_cluster()}. Lower "
            "actor_options, or add a node that has them"
        )
    num_actors = fit if fit is not None else max(1, int(ray.cluster_resources().get("CPU", 1)))
    if "num_cpus" in asked or actor_demand(asked):
        logger.info("RayRolloutExecutor: %d actors, each asking for %s (%s)",
                    num_actors, describe_options(options), describe_cluster())
    return num_actors
