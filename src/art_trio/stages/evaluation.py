"""The eval stage: runs requested evals one at a time, in the background of training.

Requests arrive over a channel from the training stage (eval steps are few and tiny, so the
channel is unbounded: the trainer never waits on eval). An eval that raises, or whose
`policy_token_spans` show tokens of another policy than the step's (see provenance.py), is
reported and training goes on; it is not logged and not retried. After a stop no new eval
starts and the running one gets the grace period; those evals stay in the persisted
`pending_eval_steps` and a resumed run does them first. A finished eval is persisted at once
in `completed_eval_steps`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio

from ..messages.errors import CallbackNotAwaitable, _BaseExceptionEscaped
from ..messages.events import EvalEnded, EvalStarted
from ..plumbing.compat import policy_spans_reported
from ..policy.batching import eval_splits, split_eval_items
from ..policy.provenance import check_eval_provenance, describe_mode
from ..run import PipelineRun
from .checkpoints import note_eval_completed

logger = logging.getLogger("art_trio")


@dataclass(eq=False)
class EvalStage:
    """Runs the evals the training stage requests, one at a time."""

    name = "eval"

    run: PipelineRun

    async def __call__(self) -> None:
        receive, stop, eval_leases = self.run.eval_receive, self.run.stop, self.run.eval_leases
        # Decided once, the model registered: whether the backend's served choices carry spans.
        strict = policy_spans_reported(self.run.model)
        logger.info(describe_mode(strict))
        try:
            async with receive:
                async for step in receive:
                    if stop.stopping:
                        # Not started before the stop: resume evaluates it (it stays scheduled).
                        continue
                    try:
                        with stop.eval_begins():
                            # Held since the step was scheduled (or from now, for the start
                            # step and resumed evals) until the eval has ended.
                            with self.run.calls.track("eval", f"the eval lease of step {step}"):
                                await eval_leases.take(step)
                            await self.evaluate(step, strict_provenance=strict)
                    finally:
                        await eval_leases.release(step)
                        stop.eval_ended()
        finally:
            # Evals that will not run now (a stop, the end): their steps need no holding.
            await eval_leases.release_all()
            stop.stage_done("eval")

    async def evaluate(self, step: int, *, strict_provenance: bool = False) -> None:
        """Evaluate the policy at `step` and log each split the eval_fn returned (with
        `strict_provenance`, an eval without policy_token_spans is refused, as in ART)."""
        ctx, calls, state = self.run, self.run.calls, self.run.state
        model = ctx.model
        self.run.emit(EvalStarted(step))
        reward: float | None = None
        completed = False
        try:
            token = model.activate_metrics_context("eval")
            started = self.run.now()
            try:
                with calls.track("eval", f"eval_fn (step {step})"):
                    result = await self.run.leases.call(
                        step, ctx.eval_fn, model, step, ctx.config, lease=ctx.eval_lease
                    )
            finally:
                token.var.reset(token)
                elapsed = self.run.now() - started
            splits = {
                split: split_eval_items(items) for split, items in eval_splits(result).items()
            }
            # Every split checked before any is logged: an eval of another policy's tokens is
            # dropped whole (ART 0.5.20+ checks each split as it logs it).
            for _groups, trajectories in splits.values():
                check_eval_provenance(step, trajectories, strict=strict_provenance)
            timing_logged = False
            for split, (groups, trajectories) in splits.items():
                if split == "val":
                    rewards = [t.reward for t in trajectories]
                    reward = sum(rewards) / len(rewards) if rewards else None
                if groups:
                    # The eval's duration rides on the first split logged.
                    metrics = None if timing_logged else {"time/step_eval_s": elapsed}
                    with calls.track("eval", f"model.log (eval of step {step}, {split})"):
                        await ctx.bridge.call(
                            model.log, groups, split=split, step=step, metrics=metrics
                        )
                    timing_logged = True
            if not timing_logged and elapsed > 0:
                await ctx.bridge.call(
                    model.log, None, split="val", step=step, metrics={"time/step_eval_s": elapsed}
                )
            note_eval_completed(model, step)
            completed = True
        except (anyio.get_cancelled_exc_class(), _BaseExceptionEscaped, CallbackNotAwaitable):
            # A stop; a KeyboardInterrupt or SystemExit; an eval_fn that can never work: each
            # ends the run, not just this eval.
            raise
        except Exception as exc:
            kind = f"{type(exc).__module__}.{type(exc).__name__}"
            logger.warning("eval at step %d failed (%s): %s; training goes on.", step, kind, exc)
            # Done with, as in ART: not retried on resume, and its checkpoint is no longer held.
            state.drop_eval(step)
        finally:
            self.run.emit(EvalEnded(step, completed, reward))
            if completed:
                state.complete_eval(step)
                # Persisted now, as ART does, so a run killed before its next step does not
                # evaluate this step again on resume.
                self.run.persist()
