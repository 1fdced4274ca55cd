"""The autotuner: the pure policy on synthetic statistics, the stage in a simulated run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from art_trio import PipelineTrainer, trio_native
from art_trio.autotune import Autotuner
from art_trio.autotune.policy import AutotunePolicy
from art_trio.autotune.profile import (
    AutotuneConfig,
    initial_runtime,
    profile_document,
    profile_path,
    save_profile,
)
from art_trio.autotune.window import InferenceLoad, parse_vllm_metrics
from art_trio.config.settings import PipelineSettings
from art_trio.messages.errors import ProfileError
from art_trio.messages.events import RunStatistics
from art_trio.plumbing.compat import PipelineAutotuneConfig, PipelineRuntimeConfig
from art_trio.sim.doubles import make_rollout_fn
from art_trio.sim.recorder import Recorder
from art_trio.sim.workloads import PRESETS
from art_trio.testing.distributions import Constant, Exponential
from tests.doubles import RecordingBackend, scenarios

# -- the pure policy ------------------------------------------------------------------------


def _stats(
    steps: int, *, t: float, train: float, workers: int, latency: float = 0.05,
    idle: float | None = None,
) -> RunStatistics:
    return RunStatistics(
        running=True, collapsed=False, policy_version=steps, steps=steps,
        num_rollout_workers=workers, min_batch_size=8, max_batch_size=8, queue_capacity=8,
        rollouts_in_flight=0, groups_queued=0, taken=8 * steps, trained=8 * steps, stale=0,
        stale_cancelled=0, zero_variance=0, errored=0, dropped_at_stop=0,
        rollouts_started=8 * steps, rollouts_lost=0, elapsed_s=t, train_s=train,
        since_first_step_s=t, trainer_utilization=train / t if t else None,
        rollout_s_spent=latency * 8 * steps, rollout_latency_s=latency, step_period_s=0.1,
        staleness={}, idle_s=t - train if idle is None else idle,
    )


class FakeRun:
    """A run whose utilization is a function of the worker count (a toy trainer)."""

    def __init__(self, policy: AutotunePolicy, utilization: Any) -> None:
        self.policy, self.utilization = policy, utilization
        self.steps, self.t, self.train, self.idle = 0, 0.0, 0.0, 0.0
        self.latency = 0.05  # each rollout's, as the statistics report it
        #: The trainer's own seconds per step besides training and waiting (logging...).
        self.overhead = 0.0

    def step(self) -> Any:
        self.steps += 1
        self.train += 0.1
        waited = 0.1 / self.utilization(self.policy.num_rollout_workers) - 0.1
        self.t += 0.1 + waited + self.overhead
        self.idle += waited
        return self.policy.observe(
            _stats(self.steps, t=self.t, train=self.train, idle=self.idle,
                   workers=self.policy.num_rollout_workers, latency=self.latency)
        )


def _policy(workers: int, **kw: Any) -> AutotunePolicy:
    return AutotunePolicy(num_rollout_workers=workers, min_batch_size=8, max_batch_size=8,
                          min_window_groups=0, **kw)


@pytest.mark.parametrize("start", [1, 4, 256])
def test_settles_on_the_fewest_workers_that_feed_the_trainer(start):
    # Utilization 1.0 from 12 workers up, 0.08 per worker missing below.
    run = FakeRun(_policy(start), lambda n: 1.0 if n >= 12 else max(0.05, 1 - 0.08 * (12 - n)))
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    assert run.policy.num_rollout_workers == 12
    assert run.policy.settled_at_step is not None and run.policy.settled_at_step < 120
    assert all(d.reason for d in decisions)
    # Settled: only holds from there on.
    after = [d for d in decisions if d.step > run.policy.settled_at_step]
    assert after and not any(d.changed for d in after)


def test_the_trainers_own_time_per_step_is_not_starvation():
    # Logging and checkpoints take a third of each step besides training: time inside
    # `backend.train` is at most 0.75 of the wall, whatever the pool. Only waiting for groups
    # is starvation, so the search still ends at the 12 workers that end the waiting.
    run = FakeRun(_policy(4), lambda n: 1.0 if n >= 12 else max(0.05, 1 - 0.08 * (12 - n)))
    run.overhead = 0.033
    for _ in range(200):
        run.step()
    assert run.policy.num_rollout_workers == 12 and run.policy.settled_at_step is not None


def test_noise_inside_the_band_does_not_move_it():
    run = FakeRun(_policy(12), lambda n: 0.96)  # between target and target + band
    decisions = [d for d in (run.step() for _ in range(100)) if d is not None]
    assert decisions and not any(d.changed for d in decisions)
    assert all("band" in d.reason for d in decisions)


def _settled_at_12(noise: Any) -> FakeRun:
    """A run settled at 12 workers (fed from 12 up), whose utilization at 12 is then
    `noise(window index)`."""
    windows = {"i": 0, "noisy": False}

    def utilization(n: int) -> float:
        if windows["noisy"] and n == 12:
            # run.steps is the step being run; after settling, windows span steps 4k+2..4k+5.
            return float(noise((run.steps - 2) // 4))
        return 1.0 if n >= 12 else 0.5

    run = FakeRun(_policy(4), utilization)
    for _ in range(120):
        run.step()
    assert run.policy.num_rollout_workers == 12 and run.policy.settled_at_step is not None
    windows["noisy"] = True
    return run


def test_a_settled_count_ignores_single_windows_a_little_under_the_target():
    # Windows around 0.96 with every other one at 0.93-0.94: noise of a count that feeds
    # the trainer (mean above the target, no clear drop).
    run = _settled_at_12(lambda i: (0.93, 0.99, 0.94, 0.98)[i % 4])
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    assert decisions and not any(d.changed for d in decisions)
    under = [d for d in decisions if "drift?" in d.reason]  # judged below the target, held
    assert len(under) >= len(decisions) // 3


def test_a_settled_count_gives_way_to_a_slow_slide_below_the_target():
    run = _settled_at_12(lambda i: 0.935)  # never a clear drop, but always below
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    moved = [d for d in decisions if d.changed]
    assert moved and moved[0].action == "increase_workers"
    assert "average utilization" in moved[0].reason and "a notch up" in moved[0].reason


def test_drift_moves_a_settled_count_up_after_sustained_starvation():
    needed = {"n": 6}
    run = FakeRun(_policy(6), lambda n: 1.0 if n >= needed["n"] else 0.5)
    for _ in range(60):
        run.step()
    settled = run.policy.num_rollout_workers
    assert settled == 6
    needed["n"] = 12  # rollouts got twice as slow
    first = None
    for _ in range(200):
        d = run.step()
        if d is not None and first is None:
            first = d
    assert first is not None and not first.changed and "drift?" in first.reason
    assert run.policy.num_rollout_workers == 12


def test_a_clear_drop_at_a_marginal_count_moves_it_up_by_the_shortfall_not_a_jump():
    # 12 settled, then reads 0.88 (two windows under 0.91: a clear drop) while 13 feeds the
    # trainer: a pool a notch short. The first search's jump (a quarter at least, or
    # Little's law with headroom) once took such a pool to twice its need late in a run.
    run = _settled_at_12(lambda i: 0.88)
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    up = next(d for d in decisions if d.changed)
    assert up.action == "increase_workers" and "shortfall here" in up.reason
    assert up.num_rollout_workers == 14  # 12 x 0.97 / 0.88, rounded up
    assert max(d.num_rollout_workers for d in decisions) == 14
    assert 12 < run.policy.num_rollout_workers <= 14
    assert not any(d.changed for d in decisions[-10:])


def test_a_single_window_falling_after_an_increase_is_not_taken_for_harm():
    # Utilization grows with the workers up to 10; 4 -> 8 workers, and the first window at 8
    # reads 0.25 (one unlucky window, 0.15 under the 0.4 at 4). One window once made 4 the
    # ceiling for the rest of the run.
    seen = {"n8": 0}

    def utilization(n: int) -> float:
        if n == 8:
            seen["n8"] += 1
            if seen["n8"] <= 5:  # the skipped step and the first window's four
                return 0.25
        return min(1.0, n / 10)

    run = FakeRun(_policy(4), utilization)
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    assert any("judged with the next window" in d.reason for d in decisions)
    assert not any("made it worse;" in d.reason for d in decisions)
    assert run.policy.ceiling is None and run.policy.num_rollout_workers >= 10


def test_a_fall_confirmed_by_the_next_window_is_harm():
    run = FakeRun(_policy(6), lambda n: 0.7 if n <= 6 else 0.55)
    decisions = [d for d in (run.step() for _ in range(100)) if d is not None]
    held = next(i for i, d in enumerate(decisions) if "judged with the next window" in d.reason)
    assert "over 2 windows" in decisions[held + 1].reason
    assert decisions[held + 1].num_rollout_workers == 6 and run.policy.ceiling == 6


def test_after_a_decrease_no_window_starts_until_the_old_pools_groups_are_retired():
    # Fed at any count: from 256 the policy decreases after every window. Each window after
    # a decrease starts skip_steps_after_decrease steps later (the trainer sets it to
    # max_steps_off_policy + 1), after an increase one step later.
    run = FakeRun(_policy(256, skip_steps_after_decrease=3), lambda n: 1.0)
    decisions = [d for d in (run.step() for _ in range(60)) if d is not None]
    steps = [d.step for d in decisions if d.action == "decrease_workers"]
    assert len(steps) >= 3
    assert {b - a for a, b in zip(steps, steps[1:], strict=False)} == {3 + 4}


def test_a_verdict_that_would_settle_the_search_waits_for_the_next_window():
    # Starved at 10, fed at 12: one lucky window at 11 would settle the search there. The
    # mean of the windows at 11 must say "fed" too, and the next window says otherwise.
    policy = _policy(11)
    policy.low, policy.high = 10, 12
    run = FakeRun(policy, lambda n: 1.0 if n >= 12 or not policy.decisions else 0.5)
    decisions = [d for d in (run.step() for _ in range(40)) if d is not None]
    first, second = decisions[:2]
    assert first.action == "hold" and not first.settled
    assert "judged with the next window" in first.reason
    assert second.action == "increase_workers" and second.num_rollout_workers == 12
    assert policy.num_rollout_workers == 12 and policy.settled_at_step is not None


def test_two_windows_that_agree_settle_the_search():
    policy = _policy(11)
    policy.low, policy.high = 10, 12
    run = FakeRun(policy, lambda n: 1.0 if n >= 11 else 0.5)
    decisions = [d for d in (run.step() for _ in range(20)) if d is not None]
    assert [d.settled for d in decisions[:2]] == [False, True]
    assert not any(d.changed for d in decisions) and policy.num_rollout_workers == 11


def test_a_probe_down_that_could_not_be_judged_by_the_last_step_is_not_begun():
    # Fed at any count: from 256 a decrease after every window (5 steps apart), unless the
    # run ends before the decrease could be judged (a skipped step and two 4-step windows).
    def decisions(max_steps: int | None) -> list[Any]:
        run = FakeRun(_policy(256, max_steps=max_steps), lambda n: 1.0)
        return [d for d in (run.step() for _ in range(24)) if d is not None]

    free, bounded = decisions(None), decisions(24)
    assert [(d.step, d.action) for d in free] == [
        (step, "decrease_workers") for step in (7, 12, 17, 22)]
    assert [(d.step, d.action) for d in bounded[:3]] == [
        (7, "decrease_workers"), (12, "decrease_workers"), (17, "hold")]  # 17 + 9 > 24
    assert "could not be judged by the last step (24)" in bounded[2].reason
    assert all(d.action == "hold" for d in bounded[2:])


def test_a_large_pool_fed_goes_down_to_littles_guess_at_once():
    # 8 groups a step, 0.1 s a step, 0.05 s a rollout: Little's law needs 4 in flight, 6
    # with headroom; from 256 the first probe goes to a sixteenth (16), not to a quarter.
    run = FakeRun(_policy(256), lambda n: 1.0)
    first = next(d for d in (run.step() for _ in range(20)) if d is not None)
    assert first.action == "decrease_workers" and first.num_rollout_workers == 16


@pytest.mark.parametrize("bound", [0, 2, None])
def test_the_trainer_sets_the_skip_after_a_decrease_and_the_last_step(model, bound):
    settings = PipelineSettings.from_flat({"max_steps_off_policy": bound, "max_steps": 50})
    run: Any = SimpleNamespace(model=model, settings=lambda: settings, stop=None,
                               observe=None, status=None, statistics=None, resize=None)
    stage = Autotuner(AutotuneConfig(mode="online")).stage(run)
    assert stage is not None
    assert stage.policy.skip_steps_after_decrease == (1 if bound is None else bound + 1)
    assert stage.policy.max_steps == 50


@pytest.mark.parametrize("start", [4, 256])
def test_workers_beyond_what_littles_law_needs_are_not_added_when_they_do_not_help(start):
    # Utilization tops out at 0.9 from 8 workers on (a staleness bound, not the workers).
    # The toy run's pace needs ~4 rollouts in flight (8 groups per 0.1 s step, 0.05 s each),
    # so 4x that, 16, is the most it is given; from 256 it comes down to 16 and holds.
    run = FakeRun(_policy(start), lambda n: 0.9 if n >= 8 else 0.5)
    decisions = [d for d in (run.step() for _ in range(200)) if d is not None]
    assert run.policy.num_rollout_workers == 16
    assert "Little's law" in decisions[-1].reason and not decisions[-1].changed
    assert max(d.num_rollout_workers for d in decisions) <= max(start, 16)


def test_the_ceiling_lifts_when_rollouts_get_slower():
    needed = {"n": 8}
    run = FakeRun(_policy(4), lambda n: 0.9 if n >= needed["n"] else 0.5)
    for _ in range(120):
        run.step()
    assert run.policy.num_rollout_workers == 16 and run.policy.ceiling == 16
    # Rollouts 4x slower: Little's law needs ~16 in flight now, 64 at 4x; the plateau moves
    # to 32 workers.
    run.latency, needed["n"] = 0.2, 32
    for _ in range(200):
        run.step()
    assert run.policy.ceiling == 64 and run.policy.num_rollout_workers == 64


def test_a_saturated_inference_server_stops_growth():
    policy = _policy(4)
    run = FakeRun(policy, lambda n: 0.5)
    loaded = InferenceLoad(running=8, waiting=16)
    decisions = []
    for _ in range(40):
        run.steps += 1
        run.train += 0.1
        run.t += 0.2
        d = policy.observe(_stats(run.steps, t=run.t, train=run.train, workers=4), loaded)
        if d is not None:
            decisions.append(d)
    assert decisions and not any(d.changed for d in decisions)
    assert "saturated" in decisions[-1].reason


def test_lowers_min_batch_size_at_the_worker_cap():
    run = FakeRun(_policy(4, max_workers=4), lambda n: 0.5)
    decisions = [d for d in (run.step() for _ in range(30)) if d is not None]
    assert decisions[0].action == "lower_min_batch_size"
    assert run.policy.min_batch_size < 8


def test_bad_targets_raise():
    with pytest.raises(ValueError):
        _policy(4, target=1.5)
    with pytest.raises(ValueError):
        _policy(4, min_workers=5, max_workers=4)


def test_parse_vllm_metrics():
    text = (
        "# HELP vllm:num_requests_running Number of requests running\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m"} 5.0\n'
    )
    load = parse_vllm_metrics(text)
    assert load == InferenceLoad(running=10.0, waiting=5.0)
    assert load.pressure == 0.5
    assert parse_vllm_metrics("nothing here\n") is None


# -- settings -------------------------------------------------------------------------------


def test_autotune_and_runtime_settings_together_raise_arts_error(model, backend):
    for extra in ({"pipeline": PipelineRuntimeConfig()}, {"num_rollout_workers": 4}):
        with pytest.raises(ValueError, match="autotuner owns"):
            PipelineTrainer(model, backend, trio_native(_never), [], None,
                            autotune=PipelineAutotuneConfig(mode="online"), **extra)


def test_online_mode_starts_from_the_configs_initial_sizes(model, backend):
    cfg = AutotuneConfig(mode="online", initial_model_calls_per_inference_gpu=6,
                         initial_min_groups_per_packed_sequence=2,
                         initial_max_groups_per_packed_sequence=5)
    trainer = PipelineTrainer(model, backend, trio_native(_never), [], None, autotune=cfg)
    assert (trainer.num_rollout_workers, trainer.min_batch_size, trainer.max_batch_size) == (
        6, 2, 5)
    assert initial_runtime(PipelineAutotuneConfig(mode="online"))["num_rollout_workers"] == 8


def test_profile_mode_needs_a_saved_profile(model, backend):
    with pytest.raises(FileNotFoundError, match="saved profile"):
        PipelineTrainer(model, backend, trio_native(_never), [], None,
                        autotune=PipelineAutotuneConfig(mode="profile"))


async def _never(model: Any, scenario: Any, config: Any) -> Any:
    raise AssertionError("not called")


# -- the stage in a real run (virtual time) ----------------------------------------------


async def test_online_run_tunes_logs_and_saves_a_profile_that_profile_mode_reads(
    model, autojump_clock, caplog
):
    backend = RecordingBackend(train_seconds=0.1)
    object.__setattr__(model, "_backend", backend)
    workload = replace(PRESETS["plenty-off1"], rollout_latency=Exponential(0.05),
                       train_time=Constant(0.1))
    rollout = trio_native(make_rollout_fn(workload, Recorder(detailed=False)))
    cfg = AutotuneConfig(mode="online", initial_model_calls_per_inference_gpu=64)
    trainer = PipelineTrainer(model, backend, rollout, _endless(), None, autotune=cfg,
                              max_steps_off_policy=1, max_steps=80, resume=False,
                              log_interval_seconds=1e9)
    caplog.set_level("INFO", logger="art_trio")
    await trainer.train(handle_signals=False)
    ids = [sid for call in backend.calls for sid in call.scenario_ids]
    assert len(ids) == len(set(ids))
    final = trainer.statistics()
    assert final.num_rollout_workers < 64  # it came down from 64
    assert any("autotune step" in r.getMessage() for r in caplog.records)
    out = Path(model._get_output_dir())
    rows = [json.loads(x) for x in (out / "history.jsonl").open()]
    tuned = [r for r in rows if "autotune/num_rollout_workers" in r]
    assert tuned and any(r["autotune/changed"] for r in tuned)
    path = profile_path(out, "latest")
    assert path == out / "pipeline_tuner" / "latest.json"
    profile = json.loads(path.read_text())
    saved = profile["settings"]["num_rollout_workers"]
    assert saved == final.num_rollout_workers
    assert profile["decisions"] and all(d["reason"] for d in profile["decisions"])
    again = PipelineTrainer(model, backend, rollout, _endless(), None,
                            autotune=PipelineAutotuneConfig(mode="profile"))
    assert again.num_rollout_workers == saved


def _endless() -> Any:
    i = 0
    while True:
        yield {"id": i, "metadata": {"scenario_id": i}}
        i += 1


_ = scenarios  # the shared doubles module (imported for its fixtures' side effects)


# -- the saved profile: read with clear errors, written durably (issue 25, cases 14, 18) -----


def _write_profile(model: Any, text: str) -> Path:
    path = profile_path(model._get_output_dir(), "latest")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


_GOOD_SETTINGS = {"num_rollout_workers": 6, "min_batch_size": 2, "max_batch_size": 4}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"settings": {"num_rollout_workers": 6', "not valid JSON"),  # torn write
        ("", "not valid JSON"),  # empty (a crash before the data reached the disk)
        ("[1, 2]", "JSON object"),
        ('{"decisions": []}', "`settings`"),
        ('{"settings": [6, 2, 4]}', "`settings`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "num_rollout_workers": "6"}}),
         "`settings.num_rollout_workers`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "num_rollout_workers": 0}}),
         "`settings.num_rollout_workers`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "min_batch_size": 2.5}}),
         "`settings.min_batch_size`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "max_batch_size": True}}),
         "`settings.max_batch_size`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "queue_maxsize": -1}}),
         "`settings.queue_maxsize`"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "min_batch_size": 8}}),
         "`settings.min_batch_size` (8) is above `settings.max_batch_size` (4)"),
        (json.dumps({"settings": {**_GOOD_SETTINGS, "num_rollout_workers": 5000}}),
         "exceeds max_rollout_workers=1024"),
    ],
)
def test_a_damaged_profile_is_a_clear_error_naming_the_file_and_field(model, backend, text,
                                                                      field):
    path = _write_profile(model, text)
    with pytest.raises(ProfileError) as caught:
        PipelineTrainer(model, backend, trio_native(_never), [], None,
                        autotune=PipelineAutotuneConfig(mode="profile"))
    message = str(caught.value)
    assert str(path) in message and field in message, message
    assert "mode='online'" in message  # what to do
    assert isinstance(caught.value, ValueError)


def test_a_profile_with_fields_missing_falls_back_to_the_configs_start(model, backend):
    _write_profile(model, json.dumps({"settings": {"num_rollout_workers": 3}}))
    cfg = AutotuneConfig(mode="profile", initial_min_groups_per_packed_sequence=2,
                         initial_max_groups_per_packed_sequence=5)
    trainer = PipelineTrainer(model, backend, trio_native(_never), [], None, autotune=cfg)
    assert (trainer.num_rollout_workers, trainer.min_batch_size, trainer.max_batch_size) == (
        3, 2, 5)


def test_a_profile_saved_by_another_model_is_applied_with_a_warning(model, backend):
    _write_profile(model, json.dumps({"model_name": "someone-else", "settings": _GOOD_SETTINGS}))
    with pytest.warns(UserWarning, match="'someone-else'.*retune"):
        trainer = PipelineTrainer(model, backend, trio_native(_never), [], None,
                                  autotune=PipelineAutotuneConfig(mode="profile"))
    assert trainer.num_rollout_workers == 6


def test_the_profile_is_saved_durably_and_a_failed_save_keeps_the_old_one(tmp_path,
                                                                           monkeypatch):
    import os

    path = tmp_path / "pipeline_tuner" / "latest.json"
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    policy = _policy(7)
    save_profile(path, profile_document(policy, AutotuneConfig(mode="online"),
                                        model_name="m", queue_maxsize=None))
    assert synced == ["file", "dir"]  # the data, then the rename
    assert json.loads(path.read_text())["settings"]["num_rollout_workers"] == 7
    assert [p.name for p in path.parent.iterdir()] == ["latest.json"]  # no temporary left

    # A write that fails half-way (a full disk) leaves the previous profile whole.
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    policy.num_rollout_workers = 9
    with pytest.raises(OSError):
        save_profile(path, profile_document(policy, AutotuneConfig(mode="online"),
                                            model_name="m", queue_maxsize=None))
    assert json.loads(path.read_text())["settings"]["num_rollout_workers"] == 7
    assert [p.name for p in path.parent.iterdir()] == ["latest.json"]


# -- the user's resize during a tuned run: theirs wins (issue 25, case 12) -------------------


def test_a_users_resize_is_adopted_and_pinned_by_the_policy():
    # At max_workers and starved, the policy lowers min_batch_size; once the user sets the
    # batch sizes, it leaves them alone (and never returns to its own stale copy).
    run = FakeRun(_policy(4, max_workers=4), lambda n: 0.5)
    run.policy.user_resized(min_batch_size=1, max_batch_size=1)
    decisions = [d for d in (run.step() for _ in range(60)) if d is not None]
    assert decisions and not any(d.changed for d in decisions)
    assert (run.policy.min_batch_size, run.policy.max_batch_size) == (1, 1)
    # Workers pinned: a starved window would add workers; it holds and says why.
    run = FakeRun(_policy(4), lambda n: 0.5)
    run.policy.user_resized(num_rollout_workers=3)
    decisions = [d for d in (run.step() for _ in range(60)) if d is not None]
    assert decisions and all(d.num_rollout_workers == 3 for d in decisions)
    assert "user's resize" in decisions[-1].reason


def test_a_resize_restarts_the_search_from_the_new_sizes():
    run = FakeRun(_policy(256), lambda n: 1.0 if n >= 12 else max(0.05, 1 - 0.08 * (12 - n)))
    for _ in range(200):
        run.step()
    assert run.policy.num_rollout_workers == 12 and run.policy.settled_at_step is not None
    run.policy.user_resized(max_batch_size=4, min_batch_size=2)  # workers not pinned
    assert run.policy.low is None and run.policy.high is None
    assert run.policy.settled_at_step is None and run.policy.pinned == {
        "max_batch_size": 4, "min_batch_size": 2}
    assert run.step() is None  # the step after a resize is not judged


def test_the_policy_judges_from_the_live_sizes():
    policy = _policy(8)
    policy.sync(5, 1, 1)
    assert (policy.num_rollout_workers, policy.min_batch_size, policy.max_batch_size) == (
        5, 1, 1)


@pytest.mark.parametrize("given", [{"min_batch_size": 1, "max_batch_size": 1},
                                   {"num_rollout_workers": 5}])
async def test_a_users_resize_during_a_tuned_run_wins_and_the_run_goes_on(
    model, autojump_clock, given
):
    import trio

    from art_trio.messages.events import Resized, StepTrained

    backend = RecordingBackend(train_seconds=0.1)
    object.__setattr__(model, "_backend", backend)
    workload = replace(PRESETS["plenty-off1"], rollout_latency=Exponential(0.05),
                       train_time=Constant(0.1))
    rollout = trio_native(make_rollout_fn(workload, Recorder(detailed=False)))
    cfg = AutotuneConfig(mode="online", initial_model_calls_per_inference_gpu=64)
    trainer = PipelineTrainer(model, backend, rollout, _endless(), None, autotune=cfg,
                              max_steps_off_policy=1, max_steps=160, resume=False,
                              log_interval_seconds=1e9)
    at_step_12 = trio.Event()
    resizes: list[tuple[int, Resized]] = []
    steps = [0]

    def observe(event: Any) -> None:
        if isinstance(event, StepTrained):
            steps[0] += 1
            if steps[0] == 12:
                at_step_12.set()
        elif isinstance(event, Resized):
            resizes.append((steps[0], event))

    trainer.add_observer(observe)
    async with trio.open_nursery() as nursery:
        await nursery.start(trainer.train)
        await at_step_12.wait()
        trainer.resize(**given, reason="user")
    final = trainer.statistics()
    assert final.steps == 160  # the run went on to its end (no ValueError from the tuner)
    for name, value in given.items():
        assert getattr(final, name) == value
    user = next(i for i, (_, e) in enumerate(resizes) if e.reason == "user")
    later = [e for _, e in resizes[user + 1:]]
    # The tuner's own changes after it keep the user's values.
    assert all(getattr(e, name) == value for e in later for name, value in given.items())
    if "num_rollout_workers" not in given:
        assert later, "the tuner went on tuning the worker count"


# -- when more workers are not the answer (issue 25, case 16 and "also seen") ----------------


def test_more_workers_that_feed_the_trainer_worse_are_taken_back():
    # Utilization falls past 32 workers (they compete for the host's CPU); Little's law
    # alone (rollouts of 1.25 s: ~125 in flight) would grow the count toward 500.
    run = FakeRun(_policy(32), lambda n: 0.6 if n <= 32 else 0.45)
    run.latency = 1.25
    decisions = [d for d in (run.step() for _ in range(150)) if d is not None]
    assert run.policy.num_rollout_workers == 32 and run.policy.ceiling == 32
    assert any("made it worse" in d.reason for d in decisions)
    assert max(d.num_rollout_workers for d in decisions) <= 128
    assert not any(d.changed for d in decisions[-10:])  # and it stays there


def test_rollouts_slowing_under_an_increase_are_not_taken_for_harm():
    # Utilization follows the workers over Little's need (6 at 50 ms rollouts). Rollouts
    # get twice as slow the moment the first increase lands: the fall after it is the
    # workload's, and the pool grows to the 12 it needs now instead of going back to 5.
    policy = _policy(5)
    run = FakeRun(policy, lambda n: min(1.0, n / (120 * run.latency)))

    def step() -> Any:
        if any(d.action == "increase_workers" for d in policy.decisions):
            run.latency = 0.1
        return run.step()

    decisions = [d for d in (step() for _ in range(150)) if d is not None]
    assert not any("made it worse" in d.reason for d in decisions)
    assert policy.ceiling is None and policy.num_rollout_workers >= 12


def test_a_ceiling_for_harm_is_lifted_when_fewer_workers_feed_the_trainer_no_better():
    # The workload turns worse for every count (a third of the utilization) as the first
    # increase lands: judged harm, 6 becomes the ceiling; back at 6 the trainer is fed no
    # better than at 12, so the ceiling goes and the search resumes.
    policy = _policy(6)
    factor = {"f": 1.0}

    def utilization(n: int) -> float:
        if any(d.action == "increase_workers" for d in policy.decisions):
            factor["f"] = 0.3
        return min(1.0, n / 12) * factor["f"]

    run = FakeRun(policy, utilization)
    decisions = [d for d in (run.step() for _ in range(150)) if d is not None]
    harm = next(i for i, d in enumerate(decisions) if "made it worse;" in d.reason)
    assert decisions[harm].num_rollout_workers == 6
    assert max(d.num_rollout_workers for d in decisions[harm:]) > 6


class EagerRun(FakeRun):
    """Eager admission past what the pace needs: every worker beyond 4 rolls out work the
    bound discards after it completed, so the yield falls as 4/n and Little's estimate
    (divided by the yield) grows with the count; utilization is flat at 0.4."""

    def __init__(self, policy: AutotunePolicy) -> None:
        super().__init__(policy, lambda n: 0.4)
        self.started = self.stale = 0.0

    def step(self) -> Any:
        self.steps += 1
        self.train += 0.1
        self.t += 0.1 / 0.4
        n = self.policy.num_rollout_workers
        ended = 8 * max(1.0, n / 4)
        self.started += ended
        self.stale += ended - 8
        stats = replace(
            _stats(self.steps, t=self.t, train=self.train, workers=n, latency=self.latency),
            rollouts_started=int(self.started), stale=int(self.stale),
        )
        return self.policy.observe(stats)


def test_eager_admission_discarding_stale_work_does_not_run_the_workers_away():
    run = EagerRun(_policy(32))
    decisions = [d for d in (run.step() for _ in range(300)) if d is not None]
    counts = [d.num_rollout_workers for d in decisions]
    assert max(counts) <= 4 * 32, counts  # it once grew 32 -> 374 -> 824
    assert run.policy.num_rollout_workers == 32 and run.policy.ceiling == 32
    assert any("gained nothing" in d.reason for d in decisions)
    assert not any(d.changed for d in decisions[-10:])


def test_flat_utilization_without_stale_discards_keeps_growing_toward_littles_ceiling():
    # The same flat 0.4 but no stale work (staleness-aware admission keeps extra workers at
    # the gate): the old rule applies, up to 4x Little's law (16 here), then holds.
    run = FakeRun(_policy(4), lambda n: 0.4)
    for _ in range(200):
        run.step()
    assert run.policy.num_rollout_workers == 16


def test_a_count_far_above_littles_law_is_probed_down_inside_the_hold_band():
    # A loaded host: 0.96 (inside the band 0.95-0.97) at any count from 10 on, so the band
    # alone held 256 for a whole run; ~4 in flight is what the pace needs.
    run = FakeRun(_policy(256), lambda n: 0.96 if n >= 10 else 0.5)
    decisions = [d for d in (run.step() for _ in range(300)) if d is not None]
    assert 10 <= run.policy.num_rollout_workers <= 16
    assert any("probing down" in d.reason for d in decisions)
    assert not any(d.changed for d in decisions[-10:])


# -- more faults tried on the tuned run ------------------------------------------------------


async def test_a_tuned_run_whose_source_ends_early_returns_and_saves_its_profile(
    model, autojump_clock
):
    # 30 scenarios: the source runs out before the first window is complete.
    backend = RecordingBackend(train_seconds=0.1)
    object.__setattr__(model, "_backend", backend)
    workload = replace(PRESETS["plenty-off1"], rollout_latency=Exponential(0.05),
                       train_time=Constant(0.1))
    rollout = trio_native(make_rollout_fn(workload, Recorder(detailed=False)))
    trainer = PipelineTrainer(model, backend, rollout, list(_take(_endless(), 30)), None,
                              autotune=AutotuneConfig(mode="online"), max_steps_off_policy=1,
                              resume=False, log_interval_seconds=1e9)
    await trainer.train(handle_signals=False)
    ids = sorted(sid for call in backend.calls for sid in call.scenario_ids)
    counters = trainer.last_counters
    assert counters is not None and len(ids) == counters.trained and len(set(ids)) == len(ids)
    assert counters.trained + counters.stale + counters.zero_variance == 30
    profile = json.loads(profile_path(model._get_output_dir(), "latest").read_text())
    assert profile["settings"]["num_rollout_workers"] == 8  # where it started: no window yet
    assert "not settled" in profile["notes"][-1]


def _take(items: Any, n: int) -> Any:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


def test_a_refused_change_is_logged_and_the_run_keeps_its_sizes(caplog):
    """The tuner never ends a run: a resize the trainer refuses leaves the live sizes."""
    from types import SimpleNamespace

    from art_trio import PipelineSettings
    from art_trio.autotune.stage import AutotuneStage
    from art_trio.autotune.window import Decision

    settings = PipelineSettings.from_flat(
        {"num_rollout_workers": 4, "min_batch_size": 8, "max_batch_size": 8}
    )

    def refuse(**change: Any) -> Any:
        raise ValueError("num_rollout_workers=9 exceeds rollout executor capacity 4")

    policy = _policy(4)
    stage = AutotuneStage(policy=policy, config=AutotuneConfig(mode="online"), model=None,
                          settings=lambda: settings, stop=SimpleNamespace(),
                          observe=SimpleNamespace(), status=SimpleNamespace(),
                          statistics=lambda: _stats(1, t=1, train=1, workers=4),
                          resize=refuse, profile=Path("/nonexistent/p.json"))
    policy.num_rollout_workers = 9  # what observe() would have set with the decision
    caplog.set_level("WARNING", logger="art_trio")
    stage._apply(Decision(12, "increase_workers", "why", 4, 9, 8, False))
    assert policy.num_rollout_workers == 4
    assert any("not applied" in r.getMessage() for r in caplog.records)
