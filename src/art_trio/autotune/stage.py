"""The autotune stage: runs `AutotunePolicy` in a live `train()` and applies its decisions.

Started by the trainer when `autotune=PipelineAutotuneConfig(mode="online")`. After each
trained step (a `StepTrained` event) it takes `trainer.statistics()`, feeds the policy and
applies a change through `trainer.resize` (the public path). Each decision is logged on the
`art_trio` logger, written to history.jsonl as `autotune/...` metrics and printed as an
`[autotune]` line beside the status line; the profile is saved beside the model
(`pipeline_tuner/<output_name>.json`, ART's place) after each change and at the end. With
an `inference_metrics_url`, vLLM's running/waiting requests are polled in the background;
a failed poll is logged once and ignored (the trainer's own measurements suffice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from ..config.settings import PipelineSettings
from ..messages.events import Observer, RunEvent, RunStatistics, StepTrained
from ..observation.status import StatusReporter
from ..plumbing.stop import StopControl
from ..stages.checkpoints import append_metrics_row
from .policy import AutotunePolicy
from .profile import config_field, profile_document, save_profile
from .window import Decision, InferenceLoad, parse_vllm_metrics

logger = logging.getLogger("art_trio")


@dataclass(kw_only=True, eq=False)
class AutotuneStage:
    name = "autotune"

    policy: AutotunePolicy
    config: Any
    model: Any
    #: The settings in force (a resize replaces them).
    settings: Callable[[], PipelineSettings]
    stop: StopControl
    observe: Callable[[Observer], Callable[[], None]]
    status: StatusReporter
    statistics: Callable[[], RunStatistics]
    resize: Callable[..., RunStatistics]
    profile: Path

    def __post_init__(self) -> None:
        self._wake = anyio.Event()
        self.inference: InferenceLoad | None = None
        #: True while the stage's own resize runs (a resize otherwise is the user's).
        self._applying = False

    def resized(self, **sizes: int | None) -> None:
        """The trainer was resized (`AutotunePolicy.user_resized`'s keywords); unless by this
        stage, by the user, whose values win."""
        if self._applying:
            return
        self.policy.user_resized(**sizes)
        logger.info("autotune: the user resized the run; left alone from now on: %s",
                    ", ".join(f"{k}={v}" for k, v in self.policy.pinned.items()))

    def _on_event(self, event: RunEvent) -> None:
        if isinstance(event, StepTrained):
            self._wake.set()

    async def __call__(self) -> None:
        remove = self.observe(self._on_event)
        url = config_field(self.config, "inference_metrics_url", None)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._wake_at_end)
                if url:
                    tg.start_soon(self._poll_inference, url)
                await self._follow()
                tg.cancel_scope.cancel()
        finally:
            remove()
            self._save()

    async def _wake_at_end(self) -> None:
        await self.stop.finished.wait()
        self._wake.set()

    async def _follow(self) -> None:
        """One observation per wake-up: after a step (or several), until the run ends."""
        stop = self.stop
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if stop.finished.is_set():
                return
            if stop.stopping:
                continue
            self._sync()  # judge from the settings in force, not a stale copy
            decision = self.policy.observe(self.statistics(), self.inference)
            if decision is not None:
                self._apply(decision)

    def _sync(self) -> None:
        # The settings, not the statistics: those count the workers still running, which
        # lag a decrease until each extra worker finishes its rollout.
        sizes = self.settings().sizes
        self.policy.sync(sizes.num_rollout_workers, sizes.min_batch_size, sizes.max_batch_size)

    def _apply(self, decision: Decision) -> None:
        if decision.changed:
            # Only what the decision changes: the batch sizes stay as they are (the user's,
            # if they resized them) unless the decision lowers min_batch_size.
            change: dict[str, Any] = {"num_rollout_workers": decision.num_rollout_workers}
            if decision.action == "lower_min_batch_size":
                change["min_batch_size"] = decision.min_batch_size
            self._applying = True
            try:
                self.resize(**change, reason=f"autotune: {decision.reason}")
            except ValueError as exc:
                # The tuner never ends a run: a change the trainer refuses (an executor's
                # capacity, sizes changed under it) is logged, and the live sizes kept.
                logger.warning("autotune step %d: %s not applied (%s); keeping the run's "
                               "sizes", decision.step, decision.action, exc)
                self._sync()
                return
            finally:
                self._applying = False
            logger.info("autotune step %d: %s", decision.step, decision.reason)
            self._save()
            self.status.write_line(
                f"[autotune] step={decision.step} {decision.action} "
                f"workers={decision.previous_workers}->{decision.num_rollout_workers} "
                f"min_batch={decision.min_batch_size} reason={decision.reason}"
            )
        else:
            logger.debug("autotune step %d: hold: %s", decision.step, decision.reason)
        w = decision.window
        row: dict[str, float] = {
            "num_rollout_workers": float(decision.num_rollout_workers),
            "min_batch_size": float(decision.min_batch_size),
            "changed": float(decision.changed),
            "settled": float(decision.settled),
        }
        if w is not None:
            row |= {"trainer_utilization": w.utilization,
                    "rollout_s_per_trained_group": w.rollout_s_per_group}
        append_metrics_row(self.model, "autotune/", decision.step, row)

    def _save(self) -> None:
        try:
            save_profile(
                self.profile,
                profile_document(
                    self.policy, self.config,
                    model_name=getattr(self.model, "name", None),
                    queue_maxsize=self.settings().sizes.queue_maxsize,
                ),
            )
        except OSError as exc:
            logger.warning("autotune: could not save the profile to %s: %s", self.profile, exc)

    async def _poll_inference(self, url: str) -> None:
        import httpx

        interval = float(config_field(self.config, "vllm_metric_interval_s", 1.0) or 1.0)
        warned = False
        async with httpx.AsyncClient(timeout=interval) as client:
            while True:
                try:
                    response = await client.get(url)
                    response.raise_for_status()
                    self.inference = parse_vllm_metrics(response.text)
                except (httpx.HTTPError, ValueError) as exc:
                    self.inference = None
                    if not warned:
                        logger.warning("autotune: inference metrics at %s unreadable (%s); "
                                       "tuning from the trainer's own measurements", url, exc)
                        warned = True
                await anyio.sleep(interval)
