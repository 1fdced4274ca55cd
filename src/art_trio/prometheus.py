"""Prometheus metrics for a `PipelineTrainer`: its live statistics and step metrics on a port.

    from art_trio.prometheus import PrometheusExporter

    with PrometheusExporter(trainer, port=9464) as exporter:   # http://127.0.0.1:9464/metrics
        await trainer.train()

Needs the extra: `pip install "art-trio[prometheus]"` (prometheus-client).

How it stays correct across threads: prometheus-client answers scrapes in its own HTTP
thread, while the trainer's state belongs to the event loop. The exporter never calls into the
trainer from the scrape thread. It registers an observer (`trainer.add_observer`), which runs
in the trainer's own task, and on events takes `trainer.statistics()` there, an immutable
`RunStatistics`, and publishes it by swapping one reference; a scrape reads the last one
published. Events come with every scenario, group and step; a snapshot is taken at least
every `min_interval` seconds of wall time on them, and on every step, publish, resize and
channel close. Rollouts starting while nothing else happens raise no event: start
`exporter.refresh_every(seconds)` beside the trainer to publish on a timer too, and call
`exporter.refresh()` (from the loop) after `train()` returns to publish its final figures.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from art_trio import (
    ChannelClosed,
    PolicyPublished,
    Resized,
    RunEvent,
    RunStatistics,
    StepTrained,
)

if TYPE_CHECKING:
    from art_trio import PipelineTrainer

#: Prefix of every metric name.
PREFIX = "art_trio"
#: Events on which a snapshot is always taken (the others: at most every `min_interval`).
_ALWAYS = (StepTrained, PolicyPublished, Resized, ChannelClosed)


@dataclass(frozen=True, slots=True)
class StepTotals:
    """The step metrics summed over the steps seen (immutable, swapped whole)."""

    steps: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    groups: int = 0
    last_step: int | None = None
    last_batch_size: int | None = None
    last_wall_s: float | None = None
    last_train_s: float | None = None


def _import_prometheus_client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:  # pragma: no cover - exercised by users without the extra
        raise ImportError(
            "art_trio.prometheus needs prometheus-client: pip install 'art-trio[prometheus]'"
        ) from exc
    return prometheus_client


class PrometheusExporter:
    """Serve a trainer's live statistics and step metrics for Prometheus to scrape.

    Args:
        trainer: the `PipelineTrainer` to watch (its observer is added here).
        host: the address to listen on; 127.0.0.1 unless you mean to expose it.
        port: the port; 0 picks a free one (read it back as `exporter.port`).
        min_interval: wall seconds between snapshots taken on frequent events.

    `start()` binds the port (a context manager does it on entering and `close()` on leaving).
    Metric names start with `art_trio_`; counters end with `_total`, durations are in
    seconds (`_seconds`). The counters count this `train()` call (a new call starts them
    again from zero, which Prometheus reads as a counter reset).
    """

    def __init__(
        self,
        trainer: PipelineTrainer[Any, Any],
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
        min_interval: float = 0.1,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port}: a TCP port is 0 (any free one) to 65535")
        if not min_interval >= 0:  # (nan too: no interval would ever pass)
            raise ValueError(f"min_interval={min_interval}: seconds >= 0")
        self._client = _import_prometheus_client()
        self.trainer = trainer
        self.host = host
        self._requested_port = port
        self.min_interval = min_interval
        # Published by the event loop, read by the scrape thread: whole immutable objects
        # swapped by one assignment, so a scrape sees one consistent snapshot.
        self._steps = StepTotals()
        self._published: tuple[RunStatistics, StepTotals] = (trainer.statistics(), self._steps)
        self._taken_at = -float("inf")
        self._server: Any = None
        self._thread: Any = None
        self.registry = self._client.CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        self._remove_observer: Callable[[], None] | None = trainer.add_observer(self._on_event)

    # -- the event loop's side ---------------------------------------------------------------

    def _on_event(self, event: RunEvent) -> None:
        if isinstance(event, StepTrained):
            s = self._steps
            self._steps = StepTotals(
                steps=s.steps + 1,
                wall_s=s.wall_s + event.wall_s,
                train_s=s.train_s + event.train_s,
                groups=s.groups + event.batch_size,
                last_step=event.step,
                last_batch_size=event.batch_size,
                last_wall_s=event.wall_s,
                last_train_s=event.train_s,
            )
        if isinstance(event, _ALWAYS) or time.monotonic() - self._taken_at >= self.min_interval:
            self.refresh()

    def refresh(self) -> RunStatistics:
        """Publish `trainer.statistics()` now (call it from the trainer's event loop)."""
        self._taken_at = time.monotonic()
        statistics = self.trainer.statistics()
        # One assignment: a scrape sees both halves from the same instant.
        self._published = (statistics, self._steps)
        return statistics

    async def refresh_every(self, seconds: float = 1.0) -> None:
        """Publish a snapshot every `seconds` until cancelled (start it beside the trainer)."""
        if not 0 < seconds < math.inf:
            raise ValueError(f"refresh_every({seconds}): seconds > 0 and finite")
        while True:
            self.refresh()
            await anyio.sleep(seconds)

    # -- serving -----------------------------------------------------------------------------

    def start(self) -> PrometheusExporter:
        """Bind the port and serve `/metrics` from a daemon thread."""
        if self._server is None:
            if self._remove_observer is None:
                self._remove_observer = self.trainer.add_observer(self._on_event)
            try:
                self._server, self._thread = self._client.start_http_server(
                    self._requested_port, addr=self.host, registry=self.registry
                )
            except OSError as exc:
                # Nothing of a failed exporter stays: it does not watch the trainer.
                self._detach()
                raise OSError(
                    exc.errno,
                    f"PrometheusExporter cannot listen on {self.host}:{self._requested_port} "
                    f"({exc.strerror or exc}): "
                    + (
                        "another process (or another exporter) uses that port. Give another "
                        "port=..., or port=0 for any free one (read back as "
                        "exporter.port), or stop what holds it"
                        if exc.errno == errno.EADDRINUSE
                        else "check the host (an address of this machine) and the port "
                        "(below 1024 needs privileges), or use port=0 for any free one"
                    ),
                ) from exc
        return self

    def _detach(self) -> None:
        remove, self._remove_observer = self._remove_observer, None
        if remove is not None:
            remove()

    @property
    def port(self) -> int:
        """The port bound (the one picked when 0 was asked for)."""
        if self._server is None:
            raise RuntimeError("the exporter is not serving: call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The address of the metrics page."""
        # An IPv6 address is bracketed in a URL (RFC 3986): http://[::1]:9464/metrics.
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and stop watching the trainer."""
        self._detach()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None

    def __enter__(self) -> PrometheusExporter:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the scrape thread's side ------------------------------------------------------------

    def families(self) -> Iterator[Any]:
        """The metric families of the last published snapshot (what a scrape returns)."""
        core = self._client.core
        s, steps = self._published

        def gauge(name: str, doc: str, value: float | None) -> Any:
            family = core.GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            if value is not None:
                family.add_metric([], float(value))
            return family

        def counter(name: str, doc: str, value: float) -> Any:
            return core.CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))

        yield gauge("running", "1 while train() runs", int(s.running))
        yield gauge("collapsed", "1 once the run stopped as collapsed (zero variance)",
                    int(s.collapsed))
        yield gauge("policy_version", "The policy version rollouts sample", s.policy_version)
        yield gauge("rollout_workers", "Rollout workers (num_rollout_workers)",
                    s.num_rollout_workers)
        yield gauge("min_batch_size", "Groups a batch waits for", s.min_batch_size)
        yield gauge("max_batch_size", "Most groups in a batch", s.max_batch_size)
        yield gauge("queue_capacity", "Capacity of the groups channel", s.queue_capacity)
        yield gauge("groups_queued", "Groups handed to the trainer, not yet trained or "
                    "discarded (the queue depth)", s.groups_queued)
        yield gauge("rollouts_in_flight", "Rollouts running now", s.rollouts_in_flight)
        yield gauge("trainer_utilization_ratio", "Share of the time since the first step "
                    "spent inside backend.train", s.trainer_utilization)
        yield gauge("rollout_latency_seconds", "Mean rollout latency the gate measured",
                    s.rollout_latency_s)
        yield gauge("step_period_seconds", "Step period the gate measured", s.step_period_s)
        yield gauge("run_elapsed_seconds", "Seconds since train() started the stages",
                    s.elapsed_s)
        yield counter("steps", "Training steps trained", s.steps)
        yield counter("scenarios_taken", "Scenarios taken from the source", s.taken)
        fates = core.CounterMetricFamily(
            f"{PREFIX}_scenarios_settled", "Scenarios taken, by how they ended", labels=["fate"]
        )
        for fate, value in (
            ("trained", s.trained),
            ("stale", s.stale),
            ("zero_variance", s.zero_variance),
            ("errored", s.errored),
            ("dropped_at_stop", s.dropped_at_stop),
        ):
            fates.add_metric([fate], float(value))
        yield fates
        yield counter("rollouts_started", "Rollouts started", s.rollouts_started)
        yield counter("rollouts_lost", "Rollouts lost with their executor worker",
                      s.rollouts_lost)
        yield counter("rollouts_stale_cancelled", "Rollouts cancelled in flight as stale",
                      s.stale_cancelled)
        yield counter("stalls", "Stalls the watchdog reported (a run that stopped moving)",
                      s.stalls)
        yield counter("train_seconds", "Seconds inside backend.train", s.train_s)
        yield counter("rollout_seconds", "Rollout-seconds spent, every rollout counted",
                      s.rollout_s_spent)
        ages = core.CounterMetricFamily(
            f"{PREFIX}_trained_groups",
            "Trained groups, by policy versions behind the policy trained from",
            labels=["policy_age"],
        )
        for age, count in sorted(s.staleness.items()):
            ages.add_metric([str(age)], float(count))
        yield ages
        # Step metrics, from the StepTrained events.
        yield core.SummaryMetricFamily(
            f"{PREFIX}_step_duration_seconds",
            "Seconds from the start of collecting a batch to the end of its step",
            count_value=steps.steps, sum_value=steps.wall_s,
        )
        yield core.SummaryMetricFamily(
            f"{PREFIX}_step_train_duration_seconds",
            "Seconds of a step inside backend.train",
            count_value=steps.steps, sum_value=steps.train_s,
        )
        yield counter("step_groups", "Groups trained by the steps seen", steps.groups)
        yield gauge("last_step", "The last step trained", steps.last_step)
        yield gauge("last_step_batch_size", "Groups in the last step's batch",
                    steps.last_batch_size)
        yield gauge("last_step_duration_seconds", "The last step's duration",
                    steps.last_wall_s)


class _Collector:
    """prometheus-client's custom collector: a scrape yields the exporter's families."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Any]:
        return self._exporter.families()


__all__ = ["PREFIX", "PrometheusExporter", "StepTotals"]
