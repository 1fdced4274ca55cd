"""The Prometheus exporter, scraped over real HTTP (httpx) in the middle of a real run, on trio
and on asyncio: the values follow the run, the names follow Prometheus' conventions."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import art
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from art_trio import PipelineTrainer, PolicyPublished, RunEvent, trio_native
from art_trio.prometheus import PrometheusExporter
from tests.doubles import RecordingBackend, scenarios, trajectory

WORKERS = 3


def scrape(url: str) -> dict[str, float]:
    """GET the page with a real HTTP client; every sample by name (labels folded in)."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def scrape_off_loop(url: str) -> dict[str, float]:
    # In a worker thread: the loop keeps running while the scrape thread answers.
    return await anyio.to_thread.run_sync(scrape, url)


async def run_and_scrape(model: art.TrainableModel, backend: RecordingBackend) -> list[Any]:
    """Two steps trained, then every worker held in its rollout: scrape; let go: scrape."""
    release = anyio.Event()
    all_held = anyio.Event()
    held = 0

    @trio_native
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        nonlocal held
        if scenario["i"] >= 4:
            held += 1
            if held == WORKERS:
                all_held.set()
            await release.wait()
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
        model, backend, rollout, scenarios(20), None,
        num_rollout_workers=WORKERS, min_batch_size=2, max_batch_size=2,
        max_steps_off_policy=8, max_steps=4, eval_every_n_steps=0,
    )
    step_2 = anyio.Event()

    def on_event(event: RunEvent) -> None:
        if isinstance(event, PolicyPublished) and event.version == 2:
            step_2.set()

    seen: list[Any] = []
    with PrometheusExporter(trainer, port=0, min_interval=0.0) as exporter:
        trainer.add_observer(on_event)  # after the exporter's: it has published by then
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics" and exporter.port
        seen.append(await scrape_off_loop(exporter.url))  # before train()
        async with anyio.create_task_group() as tg:

            async def train() -> None:
                await trainer.train(handle_signals=False)

            tg.start_soon(train)
            await all_held.wait()
            await step_2.wait()  # then nothing moves until the release
            # Published by the events so far (the last: step 2's policy published).
            seen.append(await scrape_off_loop(exporter.url))
            exporter.refresh()  # rollouts that started since: no event; refresh publishes
            seen.append(await scrape_off_loop(exporter.url))
            release.set()
        exporter.refresh()
        seen.append(await scrape_off_loop(exporter.url))
    return seen


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_scraped_during_a_run_the_values_follow_it(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    if loop == "trio":
        before, mid, held, after = trio.run(run_and_scrape, model, backend)
    else:
        before, mid, held, after = anyio.run(run_and_scrape, model, backend, backend="asyncio")

    assert before["art_trio_running"] == 0 and before["art_trio_steps_total"] == 0
    assert before["art_trio_rollout_workers"] == WORKERS

    assert mid["art_trio_running"] == 1
    assert mid["art_trio_steps_total"] == 2 == mid["art_trio_policy_version"]
    assert mid["art_trio_scenarios_settled_total{fate=trained}"] == 4
    assert mid["art_trio_step_duration_seconds_count"] == 2
    assert mid["art_trio_last_step"] == 2 and mid["art_trio_last_step_batch_size"] == 2
    assert mid["art_trio_trained_groups_total{policy_age=0}"] >= 2

    assert held["art_trio_rollouts_in_flight"] == WORKERS
    assert held["art_trio_rollouts_started_total"] >= 4 + WORKERS
    assert held["art_trio_steps_total"] == 2

    assert after["art_trio_running"] == 0 and after["art_trio_rollouts_in_flight"] == 0
    assert after["art_trio_steps_total"] == 4 == backend.step
    assert after["art_trio_scenarios_settled_total{fate=trained}"] == 8
    assert after["art_trio_step_duration_seconds_count"] == 4
    assert after["art_trio_step_train_duration_seconds_sum"] >= 0
    assert after["art_trio_last_step"] == 4


def test_names_follow_prometheus_conventions(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    trainer = PipelineTrainer(model, backend, trio_native(lambda *a: None), [], None)
    exporter = PrometheusExporter(trainer, port=0)
    names = {f.name: f for f in exporter.families()}
    assert all(n.startswith("art_trio_") for n in names)
    for name, family in names.items():
        if family.type == "counter":
            # prometheus-client appends _total to a counter's samples.
            assert all(s.name == f"{name}_total" for s in family.samples), name
        assert "_ms" not in name and "_s_" not in name and not name.endswith("_s")
    assert names["art_trio_train_seconds"].type == "counter"
    assert names["art_trio_step_duration_seconds"].type == "summary"
    exporter.close()


def test_bad_port_is_refused_with_its_value(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    trainer = PipelineTrainer(model, backend, trio_native(lambda *a: None), [], None)
    with pytest.raises(ValueError, match="port=70000"):
        PrometheusExporter(trainer, port=70000)
    with pytest.raises(RuntimeError, match="start"):
        _ = PrometheusExporter(trainer, port=0).port


def test_bad_intervals_are_refused_and_an_ipv6_url_is_bracketed(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    trainer = PipelineTrainer(model, backend, trio_native(lambda *a: None), [], None)
    with pytest.raises(ValueError, match="min_interval=nan"):
        PrometheusExporter(trainer, port=0, min_interval=float("nan"))
    exporter = PrometheusExporter(trainer, host="::1", port=0)
    for seconds in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="seconds > 0 and finite"):
            trio.run(exporter.refresh_every, seconds)
    try:
        exporter.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert exporter.url == f"http://[::1]:{exporter.port}/metrics"
        assert httpx.get(exporter.url, timeout=10).status_code == 200
    finally:
        exporter.close()


def test_the_guides_example_runs(model: art.TrainableModel, backend: RecordingBackend) -> None:
    """docs/metrics.md's example, as written but on a free port, with this test's doubles."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    block = text.split("<!-- metrics example", 1)[1].split("```python\n", 1)[1].split("```")[0]
    assert "port=9464" in block
    served: list[PrometheusExporter] = []

    class Recording(PrometheusExporter):
        def start(self) -> PrometheusExporter:
            served.append(self)
            return super().start()

    @trio_native
    async def rollout_fn(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    code = block.replace("port=9464", "port=0").replace(
        "from art_trio.prometheus import PrometheusExporter", ""
    )
    namespace = {
        "model": model, "backend": backend, "rollout_fn": rollout_fn,
        "scenarios": scenarios(8), "config": None, "PrometheusExporter": Recording,
    }
    exec(compile(code, "docs/metrics.md", "exec"), namespace)
    assert backend.step >= 1  # 8 scenarios trained in batches of 4 to 40 groups
    (exporter,) = served
    with pytest.raises(RuntimeError):
        _ = exporter.port  # served, then closed by the with block
    final = {f.name: f for f in exporter.families()}
    assert final["art_trio_steps"].samples[0].value == backend.step
    assert final["art_trio_running"].samples[0].value == 0
