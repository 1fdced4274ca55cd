"""The training stage: collect a batch, train it, log it, publish the new policy version.

Batch collection follows the reference: wait for `min_batch_size` usable groups, then take
whatever is already queued up to `max_batch_size`. Stale groups are discarded and counted;
zero-variance groups are held and logged (split "discarded") after the next step; too many
held at once stops the run as collapsed. A stop abandons collection and the preparation of a
batch not yet in `backend.train` (their groups go back to the source on resume) but never
interrupts a `backend.train` call already running.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from art import TrajectoryGroup

from ..messages.events import (
    BatchTaken,
    ChannelClosed,
    Collapsed,
    EmptyGroupReceived,
    GroupReceived,
    PolicyPublished,
    StepTrained,
    TrainCallEnded,
    TrainCallStarted,
)
from ..messages.values import Delivered, Fate
from ..observation.status import reward_summary
from ..plumbing.hooks import backend_hook
from ..policy.batching import all_failed_error, is_zero_variance
from ..policy.freshness import token_ages, tokens_by_version
from ..run import PipelineRun
from .checkpoints import after_step
from .metrics import TrainMetrics
from .train_call import CollectedBatch, TrainClock, batch_preparation, train_and_log

logger = logging.getLogger("art_trio")

#: The "discarded" split logs at most this many held zero-variance groups per step (0.5.18).
MAX_DISCARDED_GROUPS_LOGGED = 50

COLLAPSE_MESSAGE = """
========================================
MODEL COLLAPSE DETECTED - Training stopped
========================================

{limit} trajectory groups in a row came back with zero reward variance: every rollout of a
scenario scored the same, so there is nothing left to learn from, which usually means the
policy has collapsed onto one degenerate answer.

Things that help:
  - a lower learning rate, so updates are less violent
  - a reward with more spread (partial credit instead of pass/fail)
  - more varied prompts, so the policy meets situations it has not collapsed on
  - smaller batches, so the policy is corrected more often

To let the run continue regardless, raise `discard_queue_multiplier` (now
{multiplier}; the run stops at {multiplier} * min_batch_size = {limit} held groups).
"""


LONE_TRAJECTORIES_MESSAGE = """
Training stopped: {limit} trajectory groups in a row had no reward spread, and every one
held a single trajectory (or none). A group's advantages are its rewards measured against
each other, so a group of one has nothing to learn from: the policy has not collapsed, the
groups are too small. Return several rollouts of each scenario per group:
`art_trio.make_group_rollout_fn(single_rollout_fn, n=8)` builds such a rollout_fn (ART's
examples build each art.TrajectoryGroup from several rollouts of one scenario).
"""


@dataclass(eq=False)
class TrainingStage:
    """Collects batches, trains them, publishes each new policy version.

    Owns what only training needs: the ready pool (groups received and waiting for a
    batch) and the zero-variance groups held until the next step logs them.
    """

    name = "training"

    run: PipelineRun

    def __post_init__(self) -> None:
        run = self.run
        self._emit = run.emit
        self.receive = run.groups.receive_end
        #: Usable groups received from the channel, waiting for a batch (see collect_batch).
        self.ready: list[Delivered] = []
        #: Zero-variance groups held since the last step (logged as split "discarded").
        self.held_zero_variance: list[TrajectoryGroup] = []
        self._metrics = TrainMetrics(run, ready=self.ready, ready_capacity=self._ready_capacity)
        self._preparation = batch_preparation(run.backend, run.model)
        self._discard = backend_hook(run.backend, "discard_pipeline_batch")
        self._lone_said = False

    async def __call__(self) -> None:
        try:
            async with self.run.eval_send:
                try:
                    await self._train_until_done()
                except BaseException as exc:
                    # Noted first: an observer raising while the channel closes must not
                    # replace this error.
                    self.run.observers.note_failure(exc)
                    self._close_channel()
                    raise
                self._close_channel()
        finally:
            if not self.run.stop.stopping:
                # Ended on its own (max_steps, end of source, collapse): rollouts still in
                # flight can no longer be trained, so cancel them now rather than wait.
                self.run.end_rollouts_now()
            self.run.stop.stage_done("training")

    def _close_channel(self) -> None:
        """Stop receiving; what is ready or still in the channel was never trained, and a
        resumed run rolls it again."""
        left = self.ready
        self.ready = []
        # What the event reports: the channel's own buffer (observers bound its occupancy
        # with it). The drain below also takes the groups of senders blocked on a full
        # channel, and the ready pool's were taken out of it already.
        in_channel = self.receive.statistics().current_buffer_used
        while True:
            try:
                left.append(self.receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        self.receive.close()
        self.run.fates.settle_many(
            Fate.DROPPED_AT_STOP, ((item.scenario_index, 0.0) for item in left), queued=True
        )
        self._emit(ChannelClosed(in_channel))

    async def _train_until_done(self) -> None:
        max_steps = self.run.settings.shutdown.max_steps
        step = self.run.start_step
        # Counted by the trainer itself, not read off the backend's step (which is checked
        # too, see `checked_step`): max_steps bounds the number of train calls whatever the
        # backend reports.
        steps_done = 0
        while (max_steps is None or steps_done < max_steps) and not self.run.stop.stopping:
            step_started = self.run.now()
            batch = await self.collect_batch(step)
            if batch is None or not batch.items:
                return
            prepared = await self._prepare(batch)
            if prepared is not None:
                step = await self._train_step(batch, step, step_started, prepared)
                steps_done += 1
            if batch.source_ended and not self.ready:
                return

    async def _prepare(self, batch: CollectedBatch) -> dict[str, float] | None:
        """ART 0.5.20+'s `backend.prepare_pipeline_batch` on the batch about to train, where
        the backend has it (the Megatron path): the metrics it reports for the step's row, or
        None if the batch is not to be trained: the backend found nothing to train in it, or
        a stop came. Without the hook: no metrics.

        ART prepares the next batch while one trains; art_trio prepares each batch just
        before its `backend.train`. A stop cancels the preparation at once (as ART cancels
        its preparation ahead at a stop): the step has not begun, and a stop lets only a
        step already in `backend.train` finish. A batch prepared when the stop came is
        discarded (`discard_pipeline_batch`, where the backend has it) instead of trained.
        Either way its groups go back to the ready pool, which the stop drops untrained and
        unresolved, so a resumed run rolls their scenarios again.
        """
        prepare = self._preparation
        if prepare is None:
            return {}
        groups = [item.group for item in batch.items]
        s = self.run.settings
        # What the backend returned, kept where it returns it: a stop that reaches the call
        # as it returns (under trio, before the result crosses back) still finds it here.
        returned: list[Any] = []

        async def prepare_batch() -> Any:
            reported = await prepare(
                self.run.model,
                groups,
                normalize_advantages=s.training.normalize_advantages,
                grad_accumulation_sequences=s.training.grad_accumulation_sequences,
            )
            returned.append(reported)
            return reported

        try:
            with (
                anyio.CancelScope() as scope,
                self.run.calls.track("training", "backend.prepare_pipeline_batch"),
            ):
                forget = self.run.stop.on_stop(scope.cancel)
                try:
                    await self.run.bridge.call(prepare_batch)
                finally:
                    forget()
            if self.run.stop.stopping:
                if returned and returned[0] is not None:  # prepared before the stop came
                    await self._discard_prepared(groups)
                self.ready.extend(batch.items)
                return None
        except BaseException:
            # The preparation failed, or a forced stop cancelled it: the batch was not
            # trained; back in the ready pool, the channel's close drops it with the rest.
            self.ready.extend(batch.items)
            raise
        reported = returned[0]
        if reported is None:
            # As in ART: the batch is not trained. Its scenarios are done with (nothing in
            # them the backend could train), counted with the groups nothing was learnt from.
            logger.warning(
                "backend.prepare_pipeline_batch found nothing to train in a batch of %d "
                "groups; they are discarded.", len(groups),
            )
            for item in batch.items:
                self.run.fates.settle(
                    Fate.ZERO_VARIANCE, item.scenario_index, rollout_s=item.rollout_wall_s,
                    queued=True,
                )
            return None
        return {k: float(v) for k, v in dict(reported).items() if isinstance(v, (int, float))}

    async def _discard_prepared(self, groups: list[TrajectoryGroup]) -> None:
        """Let the backend drop what it prepared for a batch that will not train."""
        discard = self._discard
        if discard is not None:
            with self.run.calls.track("training", "backend.discard_pipeline_batch"):
                await self.run.bridge.call(discard, groups)

    def _ready_capacity(self) -> int:
        """What can wait for a batch after one is taken: the ready pool's rest."""
        s = self.run.settings
        largest = s.sizes.max_batch_size
        return self.run.gate.policy.lookahead(largest, s.groups_capacity) - largest

    async def collect_batch(self, current_step: int) -> CollectedBatch | None:
        """The next batch, or None if the run stopped or collapsed while collecting.

        Waits until `min_batch_size` usable groups are ready, then moves what waits in the
        channel to the ready pool, up to the admission policy's lookahead, and lets the
        policy pick up to `max_batch_size` of them (the reference takes arrival order;
        "staleness_aware" the oldest versions first). The rest stay ready for the next batch.
        """
        stale = self._stale_for(current_step)
        batch = CollectedBatch()
        started = self.run.now()
        # Groups that aged out of the window while they waited for a batch.
        for item in [item for item in self.ready if stale(item)]:
            self.ready.remove(item)
            self._discard_stale(item)
        with (
            anyio.CancelScope() as scope,
            self.run.calls.track(
                "training", f"collecting a batch for step {current_step + 1}", phase=True
            ),
        ):
            forget = self.run.stop.on_stop(scope.cancel)
            try:
                if not await self._fill(stale, batch):
                    return None
            finally:
                forget()
        if scope.cancel_called:
            # Stopped while collecting: the ready groups are neither trained nor resolved,
            # so a resumed run rolls their scenarios again.
            return None
        largest = self.run.settings.sizes.max_batch_size
        batch.items = self.run.gate.policy.take_batch(self.ready, largest)
        batch.idle_s = self.run.now() - started
        return batch

    async def _fill(self, stale: Callable[[Delivered], bool], batch: CollectedBatch) -> bool:
        """Receive until `min_batch_size` groups are ready, then what else is waiting;
        False on collapse."""
        if not self._receive_ready(stale, batch):
            return False
        while len(self.ready) < self.run.settings.sizes.min_batch_size and not batch.source_ended:
            in_channel = self._in_channel()
            try:
                item = await self.receive.receive()
            except anyio.EndOfStream:
                batch.source_ended = True
                break
            if not self._accept(item, stale, in_channel):
                return False
        return self._receive_ready(stale, batch)

    def _receive_ready(self, stale: Callable[[Delivered], bool], batch: CollectedBatch) -> bool:
        """Move groups waiting in the channel to the ready pool, up to the policy's
        lookahead; False on collapse."""
        s = self.run.settings
        lookahead = self.run.gate.policy.lookahead(s.sizes.max_batch_size, s.groups_capacity)
        while not batch.source_ended and len(self.ready) < lookahead:
            in_channel = self._in_channel()
            try:
                item = self.receive.receive_nowait()
            except anyio.WouldBlock:
                return True
            except anyio.EndOfStream:
                batch.source_ended = True
                return True
            if not self._accept(item, stale, in_channel):
                return False
        return True

    def _in_channel(self) -> int:
        """Groups in the channel now, for observers (not measured while nobody observes)."""
        if not self.run.observers.watched:
            return 0
        return self.receive.statistics().current_buffer_used

    def _discard_stale(self, item: Delivered) -> None:
        self.run.fates.settle(
            Fate.STALE, item.scenario_index, rollout_s=item.rollout_wall_s, queued=True
        )

    def _accept(
        self, item: Delivered, stale: Callable[[Delivered], bool], in_channel: int
    ) -> bool:
        """Sort one received group into the ready pool or a discard pile; False on collapse."""
        group = item.group
        self._emit(GroupReceived(item.scenario_index, item.version, in_channel))
        error = all_failed_error(group)
        if error is not None:
            raise error
        if stale(item):
            self._discard_stale(item)
            return True
        if not is_zero_variance(group):
            self.ready.append(item)
            return True
        if not group.trajectories:
            self._note_empty_group(item)
        elif len(group.trajectories) == 1:
            self._note_lone_trajectory(item)
        self.run.fates.settle(
            Fate.ZERO_VARIANCE, item.scenario_index, rollout_s=item.rollout_wall_s, queued=True
        )
        self.held_zero_variance.append(group)
        limit = self.run.settings.discard_limit
        if len(self.held_zero_variance) < limit:
            return True
        self._emit(Collapsed(len(self.held_zero_variance)))
        lone = all(len(held.trajectories) <= 1 for held in self.held_zero_variance)
        logger.error(
            (LONE_TRAJECTORIES_MESSAGE if lone else COLLAPSE_MESSAGE).format(
                limit=limit, multiplier=self.run.settings.shutdown.discard_queue_multiplier
            )
        )
        return False

    async def _train_step(
        self,
        batch: CollectedBatch,
        current_step: int,
        step_started: float,
        prepared: dict[str, float],
    ) -> int:
        expected = current_step + 1
        eval_this_step = self._should_eval(expected)
        groups = [item.group for item in batch.items]
        self.run.gate.begin_training(expected, batch_size=len(groups))
        self._emit(BatchTaken(expected, len(groups)))
        # Written before the call: if the process dies inside backend.train, resume asks the
        # backend whether this step happened and either counts these scenarios or rolls them
        # again.
        self.run.state.ledger.begin_batch(expected, (item.scenario_index for item in batch.items))
        self.run.state.at_step(current_step)
        self.run.persist()

        settled = False
        clock = TrainClock()
        self._emit(TrainCallStarted(expected, self.run.now()))
        try:
            # backend.train and model.log are both asyncio code: one crossing of the bridge
            # for the two (under trio each trio-asyncio crossing costs ~40 us).
            try:
                result = await self.run.bridge.call(
                    train_and_log, self.run, batch, groups, expected, eval_this_step,
                    step_started, self._metrics, prepared, clock,
                )
            except BaseException as exc:
                # Noted first: an observer raising on the event must not replace this error.
                self.run.observers.note_failure(exc)
                self._emit(TrainCallEnded(expected, clock.train_s or 0.0))
                raise
            train_s = clock.train_s or 0.0
            self._emit(TrainCallEnded(expected, train_s))
            new_step = int(result.step)
            await self._log_held_zero_variance(new_step)
            settled = True
            # Checkpointed: what ART's trainers ask for (eval steps), unless the run asks for
            # none at all (then nothing is tracked: the user keeps no checkpoints).
            saved = eval_this_step or not self.run.settings.persistence.save_checkpoint
            self._settle_trained(batch, new_step, step_started, train_s, saved=saved)
        except BaseException as exc:
            if not settled:
                self.run.observers.note_failure(exc)
                self._settle_unfinished(batch)
            raise
        if eval_this_step:
            self.run.state.schedule_eval(new_step)
            with self.run.calls.track("training", f"the eval lease of step {new_step}"):
                await self.run.eval_leases.take(new_step)
            self.run.eval_send.send_nowait(new_step)
        await after_step(self.run, result, new_step)
        self.run.gate.publish(new_step)
        self._emit(PolicyPublished(self.run.gate.policy_version))
        return new_step

    def _settle_trained(
        self,
        batch: CollectedBatch,
        new_step: int,
        step_started: float,
        train_s: float,
        *,
        saved: bool,
    ) -> None:
        self.run.state.ledger.commit_batch()
        self.run.state.ledger.note_checkpoint(
            new_step, (item.scenario_index for item in batch.items), saved=saved
        )
        self.run.state.at_step(new_step)
        if saved:
            self.run.state.checkpoint_saved(new_step)
        # Trained from policy version new_step - 1; unversioned groups count as fresh.
        staleness = tuple(
            0 if item.version is None else new_step - 1 - item.version for item in batch.items
        )
        self.run.fates.settle_trained(
            (item.scenario_index for item in batch.items),
            (item.rollout_wall_s for item in batch.items),
        )
        reward_mean, reward_std_mean, flat = reward_summary([item.group for item in batch.items])
        by_group = [
            token_ages(
                tokens_by_version((item.group,)) if item.tokens is None else item.tokens,
                new_step - 1,
            )
            for item in batch.items
        ]
        self._emit(
            StepTrained(
                step=new_step,
                batch_size=len(batch.items),
                scenario_indices=tuple(item.scenario_index for item in batch.items),
                staleness=staleness,
                wall_s=self.run.now() - step_started,
                train_s=train_s,
                reward_mean=reward_mean,
                reward_std_mean=reward_std_mean,
                zero_variance_groups=flat,
                token_ages=(sum(w for w, _ in by_group), sum(n for _, n in by_group)),
                token_staleness=tuple(w / n if n else None for w, n in by_group),
                idle_s=batch.idle_s,
            )
        )

    def _settle_unfinished(self, batch: CollectedBatch) -> None:
        """The batch's `backend.train` (or the logging after it) ended without a result: a
        forced stop cancelled it, or it raised.

        Its scenarios end as DROPPED_AT_STOP: this run cannot tell whether the backend
        trained them. The ledger keeps the batch pending (written before the call), and a
        resumed run settles it against the backend's step: counted as trained if the step
        advanced, rolled again if not. Nothing is lost or trained twice, and every scenario
        taken still ends in exactly one fate (with its event). Its groups left the gate's
        queue with the batch (`BatchTaken`), so they are not "queued" any more.
        """
        self.run.fates.settle_many(
            Fate.DROPPED_AT_STOP,
            ((item.scenario_index, item.rollout_wall_s) for item in batch.items),
        )

    async def _log_held_zero_variance(self, step: int) -> None:
        if not self.held_zero_variance:
            return
        held = self.held_zero_variance[:MAX_DISCARDED_GROUPS_LOGGED]
        self.held_zero_variance.clear()
        with self.run.calls.track("training", "model.log (discarded groups)"):
            await self.run.bridge.call(self.run.model.log, held, split="discarded", step=step)

    def _stale_for(self, step: int) -> Callable[[Delivered], bool]:
        """Whether a group is too old for the batch trained from `step`."""
        fresh = self.run.freshness
        return lambda item: fresh.is_stale(item.version, item.mean_version, step)

    def _note_empty_group(self, item: Delivered) -> None:
        """A group with no trajectories (and no exceptions): zero variance, as in ART, but
        said.

        Counting it silently let a rollout_fn that only returned empty groups use up a whole
        source without training a step and return normally.
        """
        self._emit(EmptyGroupReceived(item.scenario_index))
        if self.run.counters.empty_groups == 1:  # the first of the run
            warnings.warn(
                f"rollout_fn returned an art.TrajectoryGroup with no trajectories for scenario "
                f"index {item.scenario_index}; it is discarded as zero variance (nothing to "
                "learn from). If every group is empty, rollout_fn is not returning its "
                "trajectories; the run's total is in trainer.last_counters.empty_groups.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _note_lone_trajectory(self, item: Delivered) -> None:
        """A group of one trajectory: zero variance, as in ART, but said once a run."""
        if self._lone_said:
            return
        self._lone_said = True
        warnings.warn(
            f"rollout_fn returned an art.TrajectoryGroup of one trajectory for scenario "
            f"index {item.scenario_index}: a group's advantages compare its rewards with each "
            "other, so a group of one is discarded as zero variance. Return several rollouts "
            "per scenario (art_trio.make_group_rollout_fn(single_rollout_fn, n=8)).",
            RuntimeWarning,
            stacklevel=2,
        )

    def _should_eval(self, step: int) -> bool:
        every = self.run.settings.evaluation.eval_every_n_steps
        if self.run.eval_fn is None or every <= 0:
            return False
        return step - self.run.state.last_eval_step >= every
