"""Run one pipeline trainer on one workload and measure it (the child-process side).

Kinds:

* ``art``: the installed ART's ``art.pipeline_trainer.PipelineTrainer`` (its own API: 0.5.20+
  takes ``pipeline=PipelineRuntimeConfig(...)``, see compat.py) under ``asyncio.run``. Its
  ``_validate_backend_support`` is patched to a no-op: the check imports
  ``art.local.backend``, which needs torch (not installed here), and it only concerns
  ``LocalBackend``, which the synthetic backend is not.
* ``trio``: ``art_trio.PipelineTrainer`` under ``trio.run``, with asyncio rollout and eval
  functions (``asyncio.sleep``), as ART users' code is: every call crosses the trio-asyncio
  bridge. This is the path users take.
* ``trio-native``: the same under ``trio.run``, but with anyio rollouts marked
  ``art_trio.trio_native`` (no bridge): what a trio-first user could write.
* ``asyncio``: ``art_trio.PipelineTrainer`` under ``anyio.run(..., backend="asyncio")``, with
  the asyncio rollouts, i.e.
  on whatever loop asyncio makes once art_trio is imported. If anything imported trio_asyncio,
  that is trio-asyncio's ``SyncTrioEventLoop`` (its import patches ``asyncio.new_event_loop``
  process-wide; art_trio before 20e1d0d imported it eagerly). The loop class is recorded in
  every report.
* ``asyncio-selector``: as ``asyncio`` but on a plain ``asyncio.SelectorEventLoop`` passed as
  ``loop_factory`` (what the ``art`` kind runs on), to separate art_trio's own cost from the
  loop's. Not run by default.

The ``art`` kind must run in a process that never imported the ``art_trio`` package (see
``child.py``), or ART too would run on trio-asyncio's loop.

In all kinds the model is a real ``art.TrainableModel`` (base_path in a temporary directory)
whose ``log`` is replaced by an async no-op on the instance, so the benchmark measures
scheduling rather than ART's metric/parquet writing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
import sniffio

from art_trio.sim.doubles import SyntheticBackend, make_eval_fn, make_rollout_fn
from art_trio.sim.measures import RunReport, measure
from art_trio.sim.recorder import Recorder
from art_trio.sim.workloads import Workload, scenarios
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs, trainable_model

Kind = Literal["art", "trio", "trio-native", "asyncio", "asyncio-selector"]
#: Every kind, in table order.
KINDS: tuple[Kind, ...] = ("art", "trio", "trio-native", "asyncio", "asyncio-selector")
#: The kinds run unless asked otherwise.
DEFAULT_KINDS: tuple[Kind, ...] = ("art", "trio", "trio-native", "asyncio")

#: art_trio's keyword trading waste for utilization (extra rollouts admitted beyond what the
#: staleness bound guarantees trainable). Single place to rename it.
KNOB = "max_rollouts_beyond_bound"
#: art_trio's admission-policy keyword and its values.
ADMISSION = "admission"
ADMISSION_DEFAULT = "staleness_aware"
ADMISSION_EAGER = "eager"

ART_PATCH_NOTE = (
    "ART's PipelineTrainer._validate_backend_support is patched to a no-op "
    "(it imports art.local.backend, which needs torch; it only checks LocalBackend)."
)

# Status lines every hour at most: they are the same cost for every kind and only add noise.
_LOG_INTERVAL_S = 3600.0


class UnsupportedKnob(Exception):
    """The trainer under test does not accept a requested keyword argument."""


async def _noop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``model.log``: metric and trajectory logging is not what is measured."""


def _stub_log(model: Any) -> None:
    # TrainableModel is a pydantic model; object.__setattr__ puts the stub in the instance
    # dict, where attribute lookup finds it before the class's method.
    object.__setattr__(model, "log", _noop_log)


def _trainer_class(kind: Kind) -> type[Any]:
    if kind == "art":
        ArtPipelineTrainer = art_pipeline_trainer()

        def _no_validation(self: Any) -> None:
            return None

        ArtPipelineTrainer._validate_backend_support = _no_validation
        return ArtPipelineTrainer
    import art_trio

    trainer_cls: type[Any] = art_trio.PipelineTrainer
    return trainer_cls


def _mark_native(fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Mark an anyio-only callback as trio-native for art_trio (no trio-asyncio bridge)."""
    if fn is None:
        return None
    import art_trio

    marker = getattr(art_trio, "trio_native", None)
    return marker(fn) if marker is not None else fn


def _loop_name() -> str:
    """The running event loop's class (``trio`` under trio)."""
    if sniffio.current_async_library() == "trio":
        return "trio"
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}"


def _accepts(cls: type[Any], name: str) -> bool:
    params = inspect.signature(cls.__init__).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def trainer_kwargs(cls: type[Any], workload: Workload, extra: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``cls`` (ART's or art_trio's trainer) from a workload."""
    kwargs: dict[str, Any] = dict(
        num_rollout_workers=workload.workers,
        min_batch_size=workload.min_batch,
        max_batch_size=workload.max_batch,
        max_steps_off_policy=workload.max_steps_off_policy,
        max_steps=workload.steps,
        eval_every_n_steps=workload.eval_every_n_steps,
        log_interval_seconds=_LOG_INTERVAL_S,
        resume=False,
    )
    if workload.limit_mean_steps_off_policy is not None:
        # ART 0.5.20+ and art_trio only: an older ART's row reports UnsupportedKnob.
        extra = {"limit_mean_steps_off_policy": workload.limit_mean_steps_off_policy, **extra}
    if workload.eval_time is not None:
        # ART calls it eval_at_start; art_trio may call it eval_step_0.
        for name in ("eval_at_start", "eval_step_0"):
            if _accepts(cls, name):
                kwargs[name] = False
                break
    for name, value in extra.items():
        if not _accepts(cls, name):
            raise UnsupportedKnob(f"{cls.__module__}.{cls.__qualname__} has no {name!r}")
        kwargs[name] = value
    if cls is art_pipeline_trainer():
        return art_trainer_kwargs(**kwargs)  # in the installed ART's own spelling
    return kwargs


async def _drive(
    kind: Kind,
    workload: Workload,
    recorder: Recorder,
    base_path: str,
    cls: type[Any],
    kwargs: dict[str, Any],
    info: dict[str, Any],
) -> None:

    model: Any = trainable_model(
        name=f"bench-{workload.name}-{kind}",
        project="art-trio-bench",
        base_model="bench",
        base_path=base_path,
    )
    backend = SyntheticBackend(workload.train_time, recorder, seed=workload.seed)
    await model.register(backend)
    _stub_log(model)
    native = kind == "trio-native"
    rollout_fn: Callable[..., Any] | None = make_rollout_fn(
        workload, recorder, flavor="anyio" if native else "asyncio"
    )
    eval_fn: Callable[..., Any] | None = make_eval_fn(workload, recorder)
    if native:
        rollout_fn = _mark_native(rollout_fn)
        eval_fn = _mark_native(eval_fn)
    trainer = cls(
        model,
        backend,
        rollout_fn,
        scenarios(workload.scenarios),
        None,
        eval_fn,
        **kwargs,
    )
    info["event_loop"] = _loop_name()
    recorder.train_called_at = anyio.current_time()
    cpu_started = time.process_time()
    await trainer.train(handle_signals=False)
    recorder.train_returned_at = anyio.current_time()
    recorder.train_cpu_s = time.process_time() - cpu_started
    recorder.sample_rss()


def run_one(kind: Kind, workload: Workload, extra: dict[str, Any] | None = None) -> RunReport:
    """Run ``workload`` on trainer ``kind`` in this process (blocking) and measure it.

    ``extra`` is passed to the trainer constructor (the admission knobs); a keyword the
    trainer does not take raises :class:`UnsupportedKnob` before anything runs.
    """
    extra = dict(extra or {})
    cls = _trainer_class(kind)
    kwargs = trainer_kwargs(cls, workload, extra)
    recorder = Recorder(detailed=workload.detailed, rss_checkpoints=workload.rss_checkpoints)
    load_before = os.getloadavg()[0]
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="art-trio-bench-") as tmp:
        drive = functools.partial(_drive, kind, workload, recorder, tmp, cls, kwargs, info)
        if kind == "art":
            # Plain asyncio.run, the way ART's own users run it.
            asyncio.run(drive())
        elif kind in ("trio", "trio-native"):
            import trio

            trio.run(drive)
        elif kind == "asyncio":
            anyio.run(drive, backend="asyncio")
        elif kind == "asyncio-selector":
            anyio.run(
                drive,
                backend="asyncio",
                backend_options={"loop_factory": asyncio.SelectorEventLoop},
            )
        else:  # pragma: no cover - argparse restricts kinds
            raise ValueError(f"unknown trainer kind {kind!r}")
    report = measure(recorder)
    report.labels.update(
        kind=kind,
        workload=workload.name,
        seed=workload.seed,
        steps_requested=workload.steps,
        extra={k: v for k, v in extra.items()},
        # 1-minute load averages around the run: wall-time numbers mean little when other
        # processes compete for the cores.
        load1_before=load_before,
        load1_after=os.getloadavg()[0],
        event_loop=info.get("event_loop"),
        # trio_asyncio patches asyncio process-wide on import; the art kind must be free of it.
        trio_asyncio_imported="trio_asyncio" in sys.modules,
    )
    return report
