"""The scheduler's invariants, as checks over what `harness` recorded (public API of
`art_trio.testing`; `check_pipeline` in `art_trio.testing.pipeline` applies them all).

Each check raises AssertionError whose message starts with the invariant's tag (e.g.
"[off-policy bound]"), so a test can tell which invariant a counterexample broke. Expected
values are restated here from the reference's rules (never computed with art_trio's own
functions, which the mutation tests replace with broken ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from .harness import ERROR_KINDS, Case, CaseResult, RunRecord, TrainCall, is_resolved

OFF_POLICY = "off-policy bound"
MEAN_BOUND = "mean policy-age bound"
BATCH_BOUNDS = "batch bounds"
CONSERVATION = "conservation"
VERSIONS = "versions"
TERMINATION = "max_steps and termination"
EVAL = "eval schedule"
COLLAPSE = "collapse"
CAPACITY = "channel capacity"
RESUME = "resume"
ALL_FAILED = "all-failed group"
#: A user's own bound (`check_pipeline(max_policy_age=...)`), not one of the trainer's.
POLICY_AGE = "policy age"
FUTURE = "future policy version"
STALL = "no false stall"


def fail(tag: str, message: str) -> NoReturn:
    raise AssertionError(f"[{tag}] {message}")


#: Set by the mutation tests (test_mutants.py): only this invariant's failures count, here
#: and in the gate state machine (test_gate.py). A broken variant may break several
#: invariants, and which fires first on the examples drawn moves with unrelated code
#: (Hypothesis also draws from literals in art_trio's own source); each mutation test asks
#: that the invariant made for its variant catches it.
only: str | None = None


def expect(condition: bool, tag: str, message: str) -> None:
    """Fail with invariant `tag` unless `condition` (or unless only another one counts)."""
    if not condition and (only is None or only == tag):
        fail(tag, message)


@contextmanager
def only_invariant(tag: str) -> Iterator[None]:
    """Meanwhile only invariant `tag`'s failures count (see `only`)."""
    global only
    before, only = only, tag
    try:
        yield
    finally:
        only = before


def check_ran_cleanly(result: CaseResult, tag: str = TERMINATION) -> None:
    """No run hit the virtual-time bound (a deadlock) or raised."""
    for run in result.runs:
        expect(
            not run.timed_out,
            tag,
            f"run {run.index}: train() still running at virtual time {run.ended_at:g} "
            f"(bound {result.case.virtual_time_bound():g}): a finite source must end it",
        )
        expect(run.error is None, tag, f"run {run.index}: train() raised {run.error!r}")


# 1 ------------------------------------------------------------------------------------------


def check_off_policy(result: CaseResult) -> None:
    """Every group in the batch producing step s+1 started at version >= s - M, and every
    token it trained came from such a version (tokens of a rollout under in-flight updates
    span several policies: the oldest decides)."""
    m = result.case.config.max_steps_off_policy
    if m is None:
        return  # the hard bound is off (ART 0.5.20+); check_mean_bound covers the mean one
    for call in result.backend.calls:
        floor = call.step - 1 - m
        for sid, version, tokens in zip(
            call.scenario_ids, call.initial_versions, _token_versions(call), strict=True
        ):
            oldest = min([v for v, _ in tokens], default=version)
            expect(
                version is not None and version >= floor and oldest is not None
                and oldest >= floor,
                OFF_POLICY,
                f"step {call.step} trained scenario {sid} started at version {version}, its "
                f"oldest token from version {oldest}; the batch producing step {call.step} "
                f"accepts versions >= {floor} (max_steps_off_policy={m})",
            )


def _token_versions(call: TrainCall) -> list[list[tuple[int, int]]]:
    return call.token_versions or [[] for _ in call.scenario_ids]


def check_mean_bound(result: CaseResult) -> None:
    """No group in the batch producing step s+1 has a token-weighted mean policy age above
    `limit_mean_steps_off_policy`: each token aged s - the version that produced it, read
    from the group's `policy_token_spans` where it has them, else its start version."""
    limit = result.case.config.limit_mean_steps_off_policy
    if limit is None:
        return
    for call in result.backend.calls:
        for sid, version, tokens in zip(
            call.scenario_ids, call.initial_versions, _token_versions(call), strict=True
        ):
            age: float | None = None if version is None else call.step - 1 - version
            if sum(n for _, n in tokens) > 0:
                age = sum((call.step - 1 - v) * n for v, n in tokens) / sum(n for _, n in tokens)
            expect(
                age is not None and age <= limit,
                MEAN_BOUND,
                f"step {call.step} trained scenario {sid} whose mean policy age is {age} "
                f"(limit_mean_steps_off_policy={limit})",
            )


def check_policy_age(result: CaseResult, max_policy_age: int) -> None:
    """A user's own bound: no trained group is older than `max_policy_age` steps (the batch
    producing step s+1 trains only groups started at version >= s - max_policy_age)."""
    for call in result.backend.calls:
        for sid, version in zip(call.scenario_ids, call.initial_versions, strict=True):
            age = None if version is None else call.step - 1 - version
            expect(
                age is not None and age <= max_policy_age,
                POLICY_AGE,
                f"step {call.step} trained scenario {sid} started at policy version {version}: "
                f"policy age {age} > max_policy_age={max_policy_age}; the settings allow "
                f"max_steps_off_policy={result.case.config.max_steps_off_policy}, "
                f"limit_mean_steps_off_policy="
                f"{result.case.config.limit_mean_steps_off_policy}",
            )


# 2 ------------------------------------------------------------------------------------------


def source_exhausted(result: CaseResult, run: RunRecord) -> bool:
    """Every scenario of the source was taken by this run or resolved before it."""
    taken = {a.scenario_id for a in run.attempts} | set(run.resolved_before)
    return taken >= set(range(len(result.case.plans)))


def check_batch_bounds(result: CaseResult) -> None:
    """min <= len(batch) <= max, except a final batch at source exhaustion or after a stop."""
    for run in result.runs:
        for k, call in enumerate(run.calls):
            size = len(call.scenario_ids)
            # With live resizes: the bounds of any sizes in force while this batch gathered
            # (a resize at the very moment of taking may count or not).
            since = run.calls[k - 1].started_at if k else -math.inf
            in_force = run.sizes_between(since, call.started_at)
            max_batch_size = max(s.max_batch_size for s in in_force)
            min_batch_size = min(s.min_batch_size for s in in_force)
            expect(
                1 <= size <= max_batch_size,
                BATCH_BOUNDS,
                f"run {run.index} step {call.step}: batch of {size} groups "
                f"(max_batch_size={max_batch_size})",
            )
            if size >= min_batch_size:
                continue
            last = k == len(run.calls) - 1
            stopped = run.stop_requested_at is not None and run.stop_requested_at <= (
                call.started_at
            )
            expect(
                last and (stopped or source_exhausted(result, run)),
                BATCH_BOUNDS,
                f"run {run.index} step {call.step}: batch of {size} < min_batch_size="
                f"{min_batch_size}, but it is {'the last' if last else 'not the last'} "
                f"batch, the source is {'' if source_exhausted(result, run) else 'not '}"
                f"exhausted and {'a' if stopped else 'no'} stop was requested",
            )


# 3 ------------------------------------------------------------------------------------------


def replay_receives(case: Case, run: RunRecord) -> tuple[int, int, int | None]:
    """Replay the reference's sorting of received groups: (zero_variance, stale, collapse_at).

    A received group is stale if its version is below `step - M` for the step being
    collected (the start step plus the steps trained so far); otherwise a zero-variance
    group is held. Held groups are logged and released after each step; `collapse_at` is
    the index of the received group that made the held count reach the discard limit.
    """
    limit = case.config.discard_limit
    held = zero_variance = stale = 0
    steps_seen = 0
    for index, received in enumerate(run.received):
        if received.steps_done != steps_seen:
            held, steps_seen = 0, received.steps_done
        if received.all_failed:
            break
        current = run.start_step + received.steps_done
        if case.config.too_old(received.version, current, received.tokens):
            stale += 1
            continue
        if received.zero_variance:
            zero_variance += 1
            held += 1
            if held >= limit:
                return zero_variance, stale, index
    return zero_variance, stale, None


def check_conservation(result: CaseResult) -> None:
    """Each scenario taken ends exactly once; the trainer's counters match what was observed."""
    for run in result.runs:
        c = run.counters
        tag = CONSERVATION
        where = f"run {run.index}"
        expect(c is not None, tag, f"{where}: trainer.last_counters is None after train()")
        attempted = [a.scenario_id for a in run.attempts]
        expect(
            len(set(attempted)) == len(attempted),
            tag,
            f"{where}: a scenario was taken twice in one run: {sorted(attempted)}",
        )
        expect(
            c.taken == len(attempted),
            tag,
            f"{where}: counters.taken={c.taken} but the rollout fn was called "
            f"{len(attempted)} times",
        )
        trained = run.trained_ids
        expect(
            len(set(trained)) == len(trained),
            tag,
            f"{where}: a scenario was trained twice: {sorted(trained)}",
        )
        expect(
            c.trained == len(trained),
            tag,
            f"{where}: counters.trained={c.trained} but the backend trained {len(trained)} "
            "groups",
        )
        trainable = {
            a.scenario_id
            for a in run.attempts
            if a.outcome == "group"
            and not a.stopping_at_end
            and not a.zero_variance
        }
        expect(
            set(trained) <= trainable,
            tag,
            f"{where}: the backend trained scenarios {sorted(set(trained) - trainable)} "
            "whose rollout did not return a trainable group before a stop",
        )
        errored = [a for a in run.attempts if a.outcome in ERROR_KINDS and not a.stopping_at_end]
        expect(
            c.errored == len(errored),
            tag,
            f"{where}: counters.errored={c.errored} but {len(errored)} rollouts failed "
            "(raised, wrong type, NaN reward) while no stop was requested",
        )
        expect(
            c.received == len(run.received),
            tag,
            f"{where}: counters.received={c.received} but the training stage took "
            f"{len(run.received)} groups out of the channel",
        )
        zero_variance, stale_on_receive, _ = replay_receives(result.case, run)
        expect(
            c.zero_variance == zero_variance,
            tag,
            f"{where}: counters.zero_variance={c.zero_variance} but {zero_variance} "
            "zero-variance groups were received while not stale",
        )
        expect(
            c.stale >= stale_on_receive,
            tag,
            f"{where}: counters.stale={c.stale} but {stale_on_receive} groups were already "
            "stale when received",
        )
        cancelled = sum(a.outcome == "cancelled" for a in run.attempts)
        expect(
            c.stale_cancelled <= cancelled and c.stale_cancelled <= c.stale,
            tag,
            f"{where}: counters.stale_cancelled={c.stale_cancelled} but only {cancelled} "
            f"rollouts were cancelled (stale={c.stale})",
        )
        total = c.trained + c.stale + c.zero_variance + c.errored + c.dropped_at_stop
        expect(
            total == c.taken,
            tag,
            f"{where}: taken={c.taken} but trained+stale+zero_variance+errored+"
            f"dropped_at_stop = {c.trained}+{c.stale}+{c.zero_variance}+{c.errored}+"
            f"{c.dropped_at_stop} = {total}; attempts: {_attempt_summary(run)}",
        )
        # A scenario dropped at stop is one the persisted ledger leaves unresolved (a resumed
        # run rolls it again), and so is a failure no successful rollout followed (art_trio
        # resolves failures only once a rollout gets through: 66cd7a3); every other ending
        # resolves it.
        unresolved = run.unresolved_after(set(attempted))
        streak = trailing_failures(run)
        unresolved_dropped = unresolved - streak
        expect(
            len(unresolved_dropped) == c.dropped_at_stop,
            tag,
            f"{where}: the persisted ledger leaves {len(unresolved_dropped)} taken scenarios "
            f"unresolved ({sorted(unresolved_dropped)}, not counting the trailing failures "
            f"{sorted(streak)}) but counters.dropped_at_stop={c.dropped_at_stop}; attempts: "
            f"{_attempt_summary(run)}",
        )
        expect(
            not ((set(trained) | {a.scenario_id for a in errored}) - streak) & unresolved,
            tag,
            f"{where}: trained or errored scenarios "
            f"{sorted(((set(trained) | {a.scenario_id for a in errored}) - streak) & unresolved)}"
            " are not resolved in the persisted ledger",
        )
        max_steps = result.case.config.max_steps
        ended_by_exhaustion = not run.stop_requested and not run.collapsed and (
            max_steps is None or len(run.calls) < max_steps
        )
        if ended_by_exhaustion:
            expect(
                c.dropped_at_stop == 0 and not unresolved_dropped,
                tag,
                f"{where}: the run ended at the end of its source, with no stop, but "
                f"dropped_at_stop={c.dropped_at_stop} and scenarios "
                f"{sorted(unresolved_dropped)} are unresolved",
            )


def trailing_failures(run: RunRecord) -> set[int]:
    """Scenarios whose rollout failed (before any stop) with no rollout getting through
    after it: art_trio leaves them unresolved, for a resumed run to roll again."""
    streak: set[int] = set()
    for a in sorted(run.attempts, key=lambda a: a.end_seq):
        if a.stopping_at_end or a.outcome in (None, "cancelled"):
            continue
        if a.outcome in ERROR_KINDS:
            streak.add(a.scenario_id)
        else:
            streak.clear()
    return streak


def _attempt_summary(run: RunRecord) -> str:
    parts = []
    for a in run.attempts:
        stop = "@stop" if a.stopping_at_end else ""
        parts.append(f"{a.scenario_id}:{a.outcome}{stop}[{a.started_at:g}-{a.ended_at}]")
    return ", ".join(parts)


# 4 ------------------------------------------------------------------------------------------


def check_versions(result: CaseResult) -> None:
    """Published versions are consecutive from the start step; initial <= final everywhere."""
    for run in result.runs:
        where = f"run {run.index}"
        start = run.start_step
        expected = list(range(start + 1, start + 1 + len(run.publishes)))
        expect(
            run.publishes == expected,
            VERSIONS,
            f"{where}: published versions {run.publishes}, expected consecutive from "
            f"{start}: {expected}",
        )
        steps = [call.step for call in run.calls]
        expect(
            run.publishes == steps,
            VERSIONS,
            f"{where}: published versions {run.publishes} but the backend produced steps "
            f"{steps}",
        )
        for call in run.calls:
            for initial, final in call.version_pairs:
                expect(
                    initial is not None
                    and final is not None
                    and start <= initial <= final <= call.step - 1,
                    VERSIONS,
                    f"{where} step {call.step}: a trajectory has initial_policy_version="
                    f"{initial}, final_policy_version={final}; expected "
                    f"{start} <= initial <= final <= {call.step - 1}",
                )
        for attempt in run.attempts:
            if attempt.group is None:
                continue
            for t in attempt.group.trajectories:
                i, f = t.initial_policy_version, t.final_policy_version
                expect(
                    i is None or f is None or i <= f,
                    VERSIONS,
                    f"{where}: scenario {attempt.scenario_id} has initial_policy_version="
                    f"{i} > final_policy_version={f}",
                )


# 5 ------------------------------------------------------------------------------------------


def check_max_steps(result: CaseResult) -> None:
    """No run trains more than max_steps steps, and every run ends (no deadlock)."""
    check_ran_cleanly(result)
    max_steps = result.case.config.max_steps
    for run in result.runs:
        steps = len(run.calls)
        expect(
            run.counters.steps == steps,
            TERMINATION,
            f"run {run.index}: counters.steps={run.counters.steps} but the backend trained "
            f"{steps} steps",
        )
        if max_steps is not None:
            expect(
                steps <= max_steps,
                TERMINATION,
                f"run {run.index}: trained {steps} steps with max_steps={max_steps}",
            )


# 6 ------------------------------------------------------------------------------------------


def expected_eval_steps(result: CaseResult, run: RunRecord) -> list[int]:
    """The evals scheduled for a run: step 0 when eval_at_start (and the run starts at step
    0), then each step at least eval_every_n_steps after the last eval.

    A resumed run (one that found a persisted state) first runs again the evals a stop
    interrupted, and keeps the persisted every-n schedule: art_trio's documented choice
    (ART 0.5.18 instead evaluates whatever step it resumes at and restarts the schedule).
    """
    cfg = result.case.config
    if result.case.eval_seconds is None:
        return []
    state = run.state_before
    expected: list[int] = []
    last = 0
    seen: set[int] = set()
    if state is not None:
        seen = state.pending_eval_steps | state.completed_eval_steps
        expected += sorted(
            s for s in state.pending_eval_steps - state.completed_eval_steps
            if s <= run.start_step
        )
        last = state.last_eval_step
    if cfg.eval_at_start and run.start_step == 0 and run.start_step not in seen:
        expected.append(0)
        last = 0
    for call in run.calls:
        if cfg.eval_every_n_steps > 0 and call.step - last >= cfg.eval_every_n_steps:
            expected.append(call.step)
            last = call.step
    return expected


def check_evals(result: CaseResult) -> None:
    """Exactly the scheduled evals run (a prefix of them after a stop), one at a time."""
    for run in result.runs:
        where = f"run {run.index}"
        expected = expected_eval_steps(result, run)
        started = [e.step for e in run.evals]
        if run.stop_requested:
            expect(
                started == expected[: len(started)],
                EVAL,
                f"{where} (stopped): evals started for steps {started}, expected a prefix "
                f"of {expected}",
            )
        else:
            expect(
                started == expected,
                EVAL,
                f"{where}: evals started for steps {started}, expected {expected}",
            )
        expect(
            run.max_concurrent_evals <= 1,
            EVAL,
            f"{where}: {run.max_concurrent_evals} evals ran at once",
        )
        ordered = sorted(run.evals, key=lambda e: e.started_at)
        for before, after in zip(ordered, ordered[1:], strict=False):
            expect(
                before.ended_at is not None and before.ended_at <= after.started_at,
                EVAL,
                f"{where}: eval of step {after.step} started at {after.started_at:g} while "
                f"the eval of step {before.step} (until {before.ended_at}) was running",
            )
        trained_at = {call.step: call.ended_at for call in run.calls}
        for e in run.evals:
            if e.step in trained_at:
                expect(
                    e.started_at >= trained_at[e.step],
                    EVAL,
                    f"{where}: eval of step {e.step} started at {e.started_at:g} before "
                    f"step {e.step} was trained (at {trained_at[e.step]:g})",
                )


# 7 ------------------------------------------------------------------------------------------


def check_collapse(result: CaseResult) -> None:
    """Training stops exactly when held zero-variance groups reach the limit, not before."""
    for run in result.runs:
        where = f"run {run.index}"
        limit = result.case.config.discard_limit
        _, _, collapse_at = replay_receives(result.case, run)
        if collapse_at is None:
            expect(
                not run.collapsed,
                COLLAPSE,
                f"{where}: the trainer stopped as collapsed, but held zero-variance groups "
                f"never reached discard_queue_multiplier*min_batch_size={limit}",
            )
            continue
        expect(
            run.collapsed,
            COLLAPSE,
            f"{where}: held zero-variance groups reached {limit} at received group "
            f"#{collapse_at} but the trainer did not stop as collapsed",
        )
        expect(
            collapse_at == len(run.received) - 1,
            COLLAPSE,
            f"{where}: the trainer took {len(run.received) - 1 - collapse_at} more groups "
            f"after held zero-variance groups reached {limit}",
        )
        steps_then = run.received[collapse_at].steps_done
        expect(
            len(run.calls) == steps_then,
            COLLAPSE,
            f"{where}: the trainer trained {len(run.calls) - steps_then} more steps after "
            f"held zero-variance groups reached {limit}",
        )


# 8 ------------------------------------------------------------------------------------------


def check_capacity(result: CaseResult) -> None:
    """The groups channel never holds more than queue_maxsize or max(1, M * max_batch)."""
    for run in result.runs:
        # The structural half: anyio enforces the bound the channel is built with, so it must
        # be built with this one (the occupancy below only shows it when a run fills it).
        # Live resizes change it; a smaller capacity leaves what is queued in place, so the
        # occupancy is bounded by the largest capacity the run had.
        first, final = run.sizes[0].channel_capacity, run.sizes[-1].channel_capacity
        expect(
            first == result.case.config.channel_capacity,
            CAPACITY,
            f"run {run.index}: the groups channel was built with capacity {first}; the "
            f"configuration's is {result.case.config.channel_capacity}",
        )
        expect(
            run.channel_max_buffer_size == final,
            CAPACITY,
            f"run {run.index}: the groups channel ended with max_buffer_size="
            f"{run.channel_max_buffer_size}; the capacity in force was {final}",
        )
        capacity = max(s.channel_capacity for s in run.sizes)
        expect(
            run.max_channel_used <= capacity,
            CAPACITY,
            f"run {run.index}: the groups channel held {run.max_channel_used} groups; its "
            f"capacity is {capacity} (channel built with max_buffer_size="
            f"{run.channel_max_buffer_size})",
        )


# 9 ------------------------------------------------------------------------------------------


def check_resume(result: CaseResult) -> None:
    """Across a stop and a resume: no scenario is trained twice, and 1-5 hold in both runs."""
    check_ran_cleanly(result, RESUME)
    first, second = result.runs
    first_end = first.publishes[-1] if first.publishes else first.start_step
    expect(
        second.start_step == first_end,
        RESUME,
        f"the resumed run starts at step {second.start_step}, the first ended at {first_end}",
    )
    trained = [i for run in result.runs for i in run.trained_ids]
    twice = sorted({i for i in trained if trained.count(i) > 1})
    expect(not twice, RESUME, f"scenarios {twice} were trained twice across stop and resume")
    again = sorted(set(first.trained_ids) & {a.scenario_id for a in second.attempts})
    expect(
        not again,
        RESUME,
        f"scenarios {again}, trained before the stop, were rolled out again after resume",
    )
    max_steps = result.case.config.max_steps
    ran_to_end = (
        not second.stop_requested
        and not second.collapsed
        and (max_steps is None or len(second.calls) < max_steps)
    )
    if ran_to_end:
        # Only failures no rollout got through after may stay open (rolled again next time).
        unresolved = sorted(
            i
            for i in range(len(result.case.plans))
            if not is_resolved(second.state_after, i) and i not in trailing_failures(second)
        )
        expect(
            not unresolved,
            RESUME,
            f"the resumed run exhausted the source but scenarios {unresolved} were never "
            "resolved",
        )
    check_off_policy(result)
    check_mean_bound(result)
    check_batch_bounds(result)
    check_conservation(result)
    check_versions(result)
    check_max_steps(result)


# future policy versions ----------------------------------------------------------------------


def check_future_versions(result: CaseResult) -> None:
    """A trajectory from a policy version the trainer had not published is never trained:
    the run stops with FuturePolicyError (ART 0.5.23's rule), its scenario unresolved, and
    every scenario taken still ends in exactly one fate."""
    for run in result.runs:
        where = f"run {run.index}"
        for call in run.calls:
            ahead = [v for v, _ in call.version_pairs if v is not None and v > call.step - 1]
            expect(
                not ahead,
                FUTURE,
                f"{where}: step {call.step} (trained from version {call.step - 1}) trained "
                f"trajectories from versions {ahead}",
            )
        future_ids = {
            a.scenario_id for a in run.attempts if a.plan is not None and a.plan.future_by
        }
        errors = _leaves(run.error)
        expect(
            all(type(e).__name__ == "FuturePolicyError" for e in errors),
            FUTURE,
            f"{where}: train() raised {run.error!r}, not FuturePolicyError",
        )
        expect(
            not errors or bool(future_ids),
            FUTURE,
            f"{where}: FuturePolicyError without any future trajectory",
        )
        expect(
            not future_ids & set(run.trained_ids),
            FUTURE,
            f"{where}: scenarios {sorted(future_ids & set(run.trained_ids))} claiming a "
            "future policy version were trained",
        )
        c = run.counters
        total = c.trained + c.stale + c.zero_variance + c.errored + c.dropped_at_stop
        expect(
            total == c.taken == len(run.attempts),
            FUTURE,
            f"{where}: taken={c.taken} ({len(run.attempts)} rollouts) but the fates add up "
            f"to {total}",
        )
        if errors:
            raising = [
                a.scenario_id for a in run.attempts
                if a.scenario_id in future_ids and a.outcome == "group"
            ]
            expect(
                any(not is_resolved(run.state_after, i) for i in raising),
                FUTURE,
                f"{where}: the run stopped on a future version but scenarios {raising} are "
                "all resolved in the ledger",
            )


def _leaves(exc: BaseException | None) -> list[BaseException]:
    if exc is None:
        return []
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _leaves(sub)]
    return [exc]


# all-failed groups ---------------------------------------------------------------------------


def _runtime_errors(exc: BaseException | None) -> list[BaseException]:
    if exc is None:
        return []
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _runtime_errors(sub)]
    return [exc] if isinstance(exc, RuntimeError) else []


def check_all_failed(result: CaseResult) -> None:
    """An all-failed group received makes train() fail with ART's RuntimeError; state persists."""
    backend_step = result.backend.step
    for run in result.runs:
        where = f"run {run.index}"
        expect(not run.timed_out, ALL_FAILED, f"{where}: train() did not end")
        received_all_failed = [r for r in run.received if r.all_failed]
        if received_all_failed:
            errors = _runtime_errors(run.error)
            expect(
                any("rollouts in group failed" in str(e) for e in errors),
                ALL_FAILED,
                f"{where}: the trainer received the all-failed group of scenario "
                f"{received_all_failed[0].scenario_id} but train() ended with {run.error!r}",
            )
            expect(
                received_all_failed[0] is run.received[-1],
                ALL_FAILED,
                f"{where}: the trainer took more groups after an all-failed one",
            )
        else:
            expect(run.error is None, ALL_FAILED, f"{where}: train() raised {run.error!r}")
        state = run.state_after
        if state is None:
            # A stop during start-up (before any rollout) writes nothing, by design.
            expect(
                not run.attempts, ALL_FAILED,
                f"{where}: no persisted state after a train() that started rollouts",
            )
            continue
        expect(
            state.training_step == backend_step and state.ledger.pending is None,
            ALL_FAILED,
            f"{where}: persisted training_step={state.training_step}, pending batch="
            f"{state.ledger.pending}; the backend is at step {backend_step}",
        )
        not_resolved = [i for i in run.trained_ids if not is_resolved(state, i)]
        expect(
            not not_resolved,
            ALL_FAILED,
            f"{where}: trained scenarios {not_resolved} are not resolved in the persisted state",
        )



def check_no_false_stall(result: CaseResult) -> None:
    """The stall watchdog reported nothing: every rollout, train call and eval of the case
    takes less than its `stall_seconds`, so the run moved within that time, always.

    Only reports on the run's clock count: a blocked-loop report is about wall time, which
    a virtual-time run does not model.
    """
    for run in result.runs:
        false = [(at, r) for at, r in run.stalls if not r.blocked_loop]
        expect(
            not false,
            STALL,
            f"run {run.index}: a slow run that moves was reported stalled at virtual time "
            + (f"{false[0][0]:g}:\n{false[0][1].text()}" if false else ""),
        )

__all__ = [
    "ALL_FAILED",
    "BATCH_BOUNDS",
    "CAPACITY",
    "COLLAPSE",
    "CONSERVATION",
    "EVAL",
    "MEAN_BOUND",
    "OFF_POLICY",
    "POLICY_AGE",
    "RESUME",
    "STALL",
    "TERMINATION",
    "VERSIONS",
    "check_all_failed",
    "check_batch_bounds",
    "check_capacity",
    "check_collapse",
    "check_conservation",
    "check_evals",
    "check_max_steps",
    "check_mean_bound",
    "check_no_false_stall",
    "check_off_policy",
    "check_policy_age",
    "check_ran_cleanly",
    "check_resume",
    "check_versions",
    "expected_eval_steps",
    "expect",
    "fail",
    "only_invariant",
    "replay_receives",
]
