"""The suite can fail: each invariant catches a deliberately broken trainer.

Each test monkeypatches one broken variant into art_trio (a gate one version too lenient, a
collector that overfills batches, a trainer that loses a group, an eval run twice, collapse
off by one, ...), runs the invariant's property under Hypothesis, and asserts that Hypothesis
finds a counterexample that breaks *that* invariant (its tag in the AssertionError).

Strategies are those of the real properties; where a known trainer bug would make the
property fail on its own (in-flight rollouts cancelled at a stop or at max_steps are counted
nowhere), the mutant's strategy avoids those endings, so the test shows the mutant is caught,
not the bug.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, cast

import anyio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import art_trio.config.keywords
import art_trio.config.settings
import art_trio.policy.admission
import art_trio.policy.batching
import art_trio.policy.gate
import art_trio.resume.scenarios
import art_trio.stages.checkpoints
import art_trio.stages.evaluation
import art_trio.stages.rollout
import art_trio.stages.training
from art_trio.config.settings import PipelineSettings
from art_trio.messages.events import GroupReceived
from art_trio.policy.batching import Freshness
from art_trio.policy.freshness import version_tokens
from art_trio.policy.gate import PolicyGate
from art_trio.stages.evaluation import EvalStage
from art_trio.stages.rollout import RolloutStage
from art_trio.stages.training import TrainingStage
from art_trio.testing import checks
from art_trio.testing.harness import Case
from art_trio.testing.strategies import cases, resume_cases

from .test_kl_reference import KL_REFERENCE, kl_cases, prop_kl_reference_kept
from .test_trainer_invariants import (
    STRATEGIES,
    prop_all_failed_group,
    prop_batch_bounds,
    prop_channel_capacity,
    prop_collapse,
    prop_conservation,
    prop_eval_schedule,
    prop_forced_stop_in_train,
    prop_future_versions_never_train,
    prop_in_flight_bounds,
    prop_max_steps_and_termination,
    prop_off_policy_bound,
    prop_resume,
    prop_versions,
)

# Generated runs include ones whose every rollout fails on purpose; the warning that says
# so is the run's, not this test's finding.
pytestmark = pytest.mark.filterwarnings("ignore:no step was trained:RuntimeWarning")

#: Examples Hypothesis may try before the test declares the mutant uncaught.
MUTANT_BUDGET = 150
#: The gate machine's examples are cheap (no trainer run) and some of its bugs need a long
#: sequence to show: measured, the off-by-one admission bound first shows at ~150.
MACHINE_BUDGET = 600
#: Each race example is two simulated runs; the winners-alone mutant shows within a few.
RACE_MUTANT_BUDGET = 20
#: The NaN-token-weight mutant needs a bad count on an old group under the mean bound.
NAN_WEIGHT_BUDGET = 600


def _gate_one_version_too_old(s: Any) -> bool:
    """The reference's gate with its bound off by one: admits a version too old."""
    return bool(s.policy_version >= s.next_training_step - s.max_steps_off_policy - 1)


#: Only invariant `tag`'s failures count meanwhile (see checks.only).
only_invariant = checks.only_invariant


def counterexample(
    prop: Callable[[Case], None],
    strategy: st.SearchStrategy[Case],
    tag: str,
    budget: int = 0,
) -> AssertionError:
    """Run `prop` under Hypothesis; return the AssertionError of the counterexample it found.

    Fails the test if Hypothesis finds none within MUTANT_BUDGET examples, or if what it
    finds breaks another invariant than `tag`.
    """

    @settings(
        max_examples=budget or MUTANT_BUDGET,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate),
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(strategy)
    def run(case: Case) -> None:
        prop(case)

    try:
        with only_invariant(tag):
            run()
    except AssertionError as exc:
        assert f"[{tag}]" in str(exc), f"expected a [{tag}] counterexample, got: {exc}"
        return exc
    pytest.fail(f"Hypothesis found no [{tag}] counterexample against the broken variant")


# 1 ------------------------------------------------------------------------------------------


def test_off_policy_bound_catches_gate_one_version_too_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        art_trio.policy.admission, "reference_gate_allows", _gate_one_version_too_old
    )
    real_is_stale = Freshness.is_stale

    def one_version_too_old(self: Freshness, version: Any, mean: Any, step: int) -> bool:
        return real_is_stale(self, version, mean, step - 1)

    monkeypatch.setattr(Freshness, "is_stale", one_version_too_old)
    monkeypatch.setattr(
        PolicyGate,
        "min_fresh_version",
        property(lambda self: self.next_training_step - self.max_steps_off_policy - 1),
    )
    counterexample(prop_off_policy_bound, STRATEGIES[prop_off_policy_bound], checks.OFF_POLICY)


def test_mean_bound_catches_a_trainer_that_ignores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission and batching that honour only the hard bound, as ART 0.5.18 would."""
    real_is_stale, real_window = Freshness.is_stale, Freshness.window

    def hard_only(self: Freshness) -> Freshness:
        return Freshness(self.max_steps_off_policy, None)

    monkeypatch.setattr(
        Freshness,
        "is_stale",
        lambda self, version, mean, step: real_is_stale(hard_only(self), version, mean, step),
    )
    monkeypatch.setattr(
        Freshness, "window", property(lambda self: real_window.fget(hard_only(self)))
    )
    counterexample(prop_off_policy_bound, STRATEGIES[prop_off_policy_bound], checks.MEAN_BOUND)


@pytest.mark.parametrize("tag", [checks.OFF_POLICY, checks.MEAN_BOUND])
def test_in_flight_bounds_catch_a_trainer_reading_only_the_first_token(
    monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    """Tokens decoded under in-flight updates span several policies; a trainer that takes a
    group's first token's version for all of them (its start version for the hard bound,
    its mean for the mean bound) trains groups whose older tokens break the bounds."""
    stamp = art_trio.stages.rollout.stamp_policy_versions

    def first_token(group: Any) -> int | None:
        for trajectory in group.trajectories:
            for version, _ in version_tokens(trajectory):
                return version
        return None

    def first_token_stamp(group: Any, *, initial: int, final: int) -> int | None:
        oldest = stamp(group, initial=initial, final=final)
        first = first_token(group)
        return oldest if first is None else first

    def first_token_mean(group: Any) -> float | None:
        first = first_token(group)
        return None if first is None else float(first)

    monkeypatch.setattr(art_trio.stages.rollout, "stamp_policy_versions", first_token_stamp)
    monkeypatch.setattr(art_trio.stages.rollout, "mean_policy_version", first_token_mean)
    # Cases without failures or stops, where every group trains or goes stale on its tokens'
    # versions alone: the full strategy's examples found the mutant only late in its budget.
    counterexample(
        prop_in_flight_bounds, cases(failures=(), stop=False, in_flight=True), tag, budget=300
    )


# 2 ------------------------------------------------------------------------------------------


def test_batch_bounds_catches_collector_exceeding_max(monkeypatch: pytest.MonkeyPatch) -> None:
    # A collector that takes one group more than max_batch_size when it can.
    real = TrainingStage.collect_batch

    async def overfilling(self: TrainingStage, current_step: int) -> Any:
        live = self.run.settings
        self.run.settings = live.replace(max_batch_size=live.sizes.max_batch_size + 1)
        try:
            return await real(self, current_step)
        finally:
            self.run.settings = live

    monkeypatch.setattr(TrainingStage, "collect_batch", overfilling)
    counterexample(prop_batch_bounds, STRATEGIES[prop_batch_bounds], checks.BATCH_BOUNDS)


def test_batch_bounds_catches_collector_not_waiting_for_min(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A collector that trains whatever single group is ready (min_batch_size ignored).
    real = TrainingStage.collect_batch

    async def impatient(self: TrainingStage, current_step: int) -> Any:
        live = self.run.settings
        self.run.settings = live.replace(min_batch_size=1)
        try:
            return await real(self, current_step)
        finally:
            self.run.settings = live

    monkeypatch.setattr(TrainingStage, "collect_batch", impatient)
    counterexample(prop_batch_bounds, STRATEGIES[prop_batch_bounds], checks.BATCH_BOUNDS)


# 3 ------------------------------------------------------------------------------------------


def test_conservation_catches_trainer_losing_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    real = TrainingStage._accept

    def losing(self: TrainingStage, item: Any, stale: Any, in_channel: int) -> bool:
        if item.scenario_index % 3 == 2:
            # Taken out of the channel, then forgotten: counted nowhere, never resolved.
            self.run.observers.emit(GroupReceived(item.scenario_index, item.version, in_channel))
            self.run.gate.group_discarded()
            return True
        return bool(real(self, item, stale, in_channel))

    monkeypatch.setattr(TrainingStage, "_accept", losing)
    counterexample(prop_conservation, cases(stop=False, max_steps=False), checks.CONSERVATION)


def test_conservation_catches_worker_dropping_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    real_post_init = RolloutStage.__post_init__

    class DroppingSend:
        """A worker's end of the channel that silently loses every third group."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def clone(self) -> DroppingSend:
            return DroppingSend(self._inner.clone())

        async def send(self, item: Any) -> None:
            if item.scenario_index % 3 != 2:
                await self._inner.send(item)

        def send_nowait(self, item: Any) -> None:
            if item.scenario_index % 3 != 2:
                self._inner.send_nowait(item)

        async def __aenter__(self) -> DroppingSend:
            await self._inner.__aenter__()
            return self

        async def __aexit__(self, *exc: Any) -> None:
            await self._inner.__aexit__(*exc)

    def dropping(self: RolloutStage) -> None:
        real_post_init(self)
        self.send = cast(Any, DroppingSend(self.send))

    monkeypatch.setattr(RolloutStage, "__post_init__", dropping)
    counterexample(prop_conservation, cases(stop=False, max_steps=False), checks.CONSERVATION)


def test_conservation_catches_bad_token_counts_trained(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout stage that takes infinite, NaN or negative `completion_tokens` as they come
    (issue 25's case 2): those groups are trained or discarded instead of errored."""
    monkeypatch.setattr(art_trio.policy.batching, "token_count_problem", lambda i, t: None)
    counterexample(prop_conservation, STRATEGIES[prop_conservation], checks.CONSERVATION)


def test_mean_bound_catches_nan_token_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25's case 2 as it was: no rejection, a NaN mean, and a rule that reads a NaN
    mean as fresh; an old group with an infinite count passes the mean bound."""
    monkeypatch.setattr(art_trio.policy.batching, "token_count_problem", lambda i, t: None)

    def naive_mean(group: Any) -> float | None:
        total = weight = 0.0
        for t in group.trajectories:
            w = t.metrics.get("completion_tokens", 1.0)
            w = 1.0 if isinstance(w, int | float) and w == 0 else float(w)
            total, weight = total + t.initial_policy_version * w, weight + w
        return total / weight if weight else None

    def nan_is_fresh(self: Freshness, version: Any, mean: Any, step: int) -> bool:
        m, limit = self.max_steps_off_policy, self.limit_mean_steps_off_policy
        if m is not None and version is not None and version < step - m:
            return True
        mean = version if mean is None else mean
        return limit is not None and mean is not None and step - mean > limit

    monkeypatch.setattr(art_trio.stages.rollout, "mean_policy_version", naive_mean)
    monkeypatch.setattr(Freshness, "is_stale", nan_is_fresh)
    # Measured: the derandomized sequence shows it after more than 150 examples and within
    # 600 (the bad count must land on an old group while the mean bound is the binding one).
    counterexample(
        prop_off_policy_bound,
        cases(failures=("tokens_inf", "tokens_nan")),
        checks.MEAN_BOUND,
        budget=NAN_WEIGHT_BUDGET,
    )


def test_conservation_catches_an_unfinished_train_call_losing_its_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25's case 6 as it was: the batch inside a force-stopped `backend.train` ends in
    no fate."""
    monkeypatch.setattr(TrainingStage, "_settle_unfinished", lambda self, batch: None)
    counterexample(
        prop_forced_stop_in_train, STRATEGIES[prop_forced_stop_in_train], checks.CONSERVATION
    )


# 4 ------------------------------------------------------------------------------------------


def test_versions_catches_swapped_version_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    real = art_trio.stages.rollout.stamp_policy_versions

    def swapped(group: Any, *, initial: int, final: int) -> int | None:
        return real(group, initial=final, final=initial)

    monkeypatch.setattr(art_trio.stages.rollout, "stamp_policy_versions", swapped)
    counterexample(prop_versions, STRATEGIES[prop_versions], checks.VERSIONS)


def test_versions_catches_a_skipped_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    real = PolicyGate.publish

    def skipping(self: PolicyGate, version: int) -> None:
        real(self, version + 1 if version == 2 else version)

    monkeypatch.setattr(PolicyGate, "publish", skipping)
    counterexample(prop_versions, STRATEGIES[prop_versions], checks.VERSIONS)


# 5 ------------------------------------------------------------------------------------------


def test_max_steps_catches_one_step_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    real = art_trio.config.keywords.resolve_settings

    def one_more(*args: Any, **kwargs: Any) -> PipelineSettings:
        s = real(*args, **kwargs)
        steps = s.shutdown.max_steps
        return s if steps is None else s.replace(max_steps=steps + 1)

    monkeypatch.setattr(art_trio.config.keywords, "resolve_settings", one_more)
    counterexample(
        prop_max_steps_and_termination,
        STRATEGIES[prop_max_steps_and_termination],
        checks.TERMINATION,
    )


def test_termination_catches_trainer_waiting_past_end_of_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = TrainingStage.collect_batch

    async def waiting(self: TrainingStage, current_step: int) -> Any:
        batch = await real(self, current_step)
        if batch is not None and batch.source_ended:
            await anyio.sleep_forever()  # expects more groups after the end: a deadlock
        return batch

    monkeypatch.setattr(TrainingStage, "collect_batch", waiting)
    counterexample(
        prop_max_steps_and_termination,
        cases(stop=False, max_steps=False),
        checks.TERMINATION,
    )


# 6 ------------------------------------------------------------------------------------------


def test_eval_schedule_catches_eval_one_step_late(monkeypatch: pytest.MonkeyPatch) -> None:
    def late(self: TrainingStage, step: int) -> bool:
        every = self.run.settings.evaluation.eval_every_n_steps
        return bool(
            self.run.eval_fn is not None
            and every > 0
            and step - self.run.state.last_eval_step > every
        )

    monkeypatch.setattr(TrainingStage, "_should_eval", late)
    counterexample(prop_eval_schedule, STRATEGIES[prop_eval_schedule], checks.EVAL)


def test_eval_schedule_catches_eval_run_twice_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real = EvalStage.evaluate

    async def twice(self: EvalStage, step: int, *, strict_provenance: bool = False) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(
                    functools.partial(real, self, step, strict_provenance=strict_provenance)
                )

    monkeypatch.setattr(EvalStage, "evaluate", twice)
    counterexample(prop_eval_schedule, STRATEGIES[prop_eval_schedule], checks.EVAL)


# 7 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("off_by", [1, -1], ids=["one_late", "one_early"])
def test_collapse_catches_limit_off_by_one(monkeypatch: pytest.MonkeyPatch, off_by: int) -> None:
    monkeypatch.setattr(
        PipelineSettings,
        "discard_limit",
        property(lambda s: s.shutdown.discard_queue_multiplier * s.sizes.min_batch_size + off_by),
    )
    counterexample(prop_collapse, STRATEGIES[prop_collapse], checks.COLLAPSE)


# 8 ------------------------------------------------------------------------------------------


def test_capacity_catches_oversized_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        PipelineSettings,
        "groups_capacity",
        property(
            lambda s: (
                2
                * (
                    s.sizes.queue_maxsize
                    or max(1, s.freshness.max_steps_off_policy * s.sizes.max_batch_size)
                )
            )
        ),
    )
    counterexample(prop_channel_capacity, STRATEGIES[prop_channel_capacity], checks.CAPACITY)


# 9 ------------------------------------------------------------------------------------------


def test_resume_catches_ledger_forgetting_trained_scenarios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forgetting(self: art_trio.resume.scenarios.ScenarioLedger) -> None:
        self.pending = None  # the batch trained, but its scenarios are never resolved

    ledger = art_trio.resume.scenarios.ScenarioLedger
    monkeypatch.setattr(ledger, "commit_batch", forgetting)
    counterexample(
        prop_resume,
        # Stops that wait for in-flight rollouts, so the known in-flight bug cannot fire.
        resume_cases(second_stop=False, max_steps=False, grace=(None,)),
        checks.RESUME,
    )


# all-failed groups ---------------------------------------------------------------------------


def test_future_versions_catch_a_trainer_counting_them_fresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25's case 1 as it was: a version ahead of the trainer's passes either bound."""
    monkeypatch.setattr(
        art_trio.stages.rollout, "future_policy_error", lambda *args, **kwargs: None
    )
    counterexample(
        prop_future_versions_never_train,
        STRATEGIES[prop_future_versions_never_train],
        checks.FUTURE,
    )


def test_all_failed_catches_trainer_ignoring_all_failed_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(art_trio.stages.training, "all_failed_error", lambda group: None)
    counterexample(prop_all_failed_group, STRATEGIES[prop_all_failed_group], checks.ALL_FAILED)


# the KL reference ------------------------------------------------------------------------------


def test_kl_reference_catches_retention_forgetting_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention protecting only the current, leased and eval-pending steps (art_trio before
    issue 24, and ART 0.5.18) deletes the KL penalty's reference checkpoint."""
    monkeypatch.setattr(
        art_trio.stages.checkpoints, "kl_reference_steps", lambda settings, step: set()
    )
    counterexample(prop_kl_reference_kept, kl_cases(), KL_REFERENCE)


# the gate alone --------------------------------------------------------------------------------


def machine_counterexample(tag: str) -> None:
    """Run the gate state machine; assert Hypothesis finds a run breaking invariant `tag`."""
    from hypothesis.stateful import run_state_machine_as_test

    from .test_gate import GateMachine

    with only_invariant(tag), pytest.raises(AssertionError, match=re.escape(f"[{tag}]")):
        run_state_machine_as_test(
            GateMachine,
            settings=settings(
                max_examples=MACHINE_BUDGET,
                derandomize=True,
                database=None,
                deadline=None,
                phases=(Phase.generate,),
                report_multiple_bugs=False,
                print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )


def test_gate_machine_catches_admission_one_version_too_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        art_trio.policy.admission, "reference_gate_allows", _gate_one_version_too_old
    )
    from .test_gate import ADMISSION_BOUND

    machine_counterexample(ADMISSION_BOUND)


def test_gate_machine_catches_hand_over_leaking_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def leaking(self: PolicyGate, version: int) -> None:
        self._queued += 1  # the in-flight slot is never given back

    monkeypatch.setattr(PolicyGate, "hand_over", leaking)
    from .test_gate import IN_FLIGHT

    machine_counterexample(IN_FLIGHT)


def test_gate_machine_catches_discard_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    real = PolicyGate.group_discarded

    def twice(self: PolicyGate, *, scored_alike: bool = False) -> None:
        self._queued -= 1
        real(self, scored_alike=scored_alike)

    monkeypatch.setattr(PolicyGate, "group_discarded", twice)
    from .test_gate import QUEUED

    machine_counterexample(QUEUED)


def test_gate_machine_catches_doomed_bound_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        PolicyGate,
        "min_fresh_version",
        property(lambda self: self.next_training_step - self.max_steps_off_policy + 1),
    )
    from .test_gate import DOOMED

    machine_counterexample(DOOMED)


def test_gate_machine_catches_publish_not_ending_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = PolicyGate.publish

    def stuck(self: PolicyGate, version: int) -> None:
        real(self, version)
        self._next_training_step = version + 1  # still "training" after the publish

    monkeypatch.setattr(PolicyGate, "publish", stuck)
    from .test_gate import VERSIONS

    machine_counterexample(VERSIONS)


# The stall watchdog -------------------------------------------------------------------------


def test_no_false_stall_catches_a_watchdog_counting_only_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watchdog that takes only a finished step for the run moving reports every run whose
    steps are further apart than `stall_seconds`, though its rollouts each end well within it."""
    from art_trio.watchdog.stage import WatchdogStage

    from .test_stall_watchdog import prop_no_false_stall, slow_cases

    monkeypatch.setattr(WatchdogStage, "_moved", lambda self: (0, self.counters.steps, 0))
    counterexample(prop_no_false_stall, slow_cases(), checks.STALL)


def test_shared_server_progress_catches_a_gate_that_wakes_no_one_on_a_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51's livelock as it was: a group handed over frees its slot on the shared
    server, and a rollout's time moves the load model, but neither wakes the workers
    waiting at the gate; under the load cap they wait for good once the rollouts in flight
    have all handed over. (Dropping the hand-over's wake-up alone is masked in a run: the
    next rollout's time note, made while its own slot is still counted, wakes them for the
    slots freed before; the gate-level tests in tests/test_admission_queueing.py catch each
    wake-up alone.) The issue's workloads: the mutant first shows there."""
    from .test_shared_server import PROGRESS, prop_shared_server_progress, shared_server_specs

    def silent_hand_over(self: PolicyGate, version: int) -> None:
        self._release(version)
        self._queued += 1

    real_note = PolicyGate.note_rollout_time

    def silent_note(self: PolicyGate, seconds: float, *, completed: bool) -> None:
        self._pump = lambda: None  # type: ignore[method-assign]
        try:
            real_note(self, seconds, completed=completed)
        finally:
            del self._pump

    monkeypatch.setattr(PolicyGate, "hand_over", silent_hand_over)
    monkeypatch.setattr(PolicyGate, "note_rollout_time", silent_note)
    counterexample(
        prop_shared_server_progress, shared_server_specs(as_reported=True), PROGRESS
    )


def test_window_promise_catches_admission_blind_to_queueing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission that ignores the shared server's load (latency measured at today's load
    only, as before the load model) admits rollouts the server cannot finish in time."""
    from art_trio.admission import MeasuredSnapshot

    from .test_gate import test_admitted_rollouts_can_finish_inside_the_window

    monkeypatch.setattr(MeasuredSnapshot, "load_cap", property(lambda self: None))
    with pytest.raises(AssertionError):
        test_admitted_rollouts_can_finish_inside_the_window()


def test_race_property_catches_judging_from_the_winners_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gate that reads the slow tail from completed rollouts only, as if the cancelled
    losers of a race were never run: a race's winners look alike whatever the latencies, so
    it narrows the race on independent latencies and the trainer waits for batches."""
    import art_trio.admission.gate
    from art_trio.admission.snapshot import latency_tail

    from .test_race import independent, prop_independent_race_stays_wide

    monkeypatch.setattr(
        art_trio.admission.gate, "latency_tail", lambda done, cancelled: latency_tail(done, ())
    )

    @settings(max_examples=RACE_MUTANT_BUDGET, derandomize=True, database=None, deadline=None)
    @given(independent)
    def run(spec: Any) -> None:
        prop_independent_race_stays_wide(spec)

    with pytest.raises(AssertionError, match="the race narrowed on independent latencies"):
        run()
