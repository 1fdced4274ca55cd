"""Your own extensions: an admission policy and a stage beside the trainer's, from the protocols.

The kernel defines how an extension plugs in (docs/architecture.md, "Kernel and extensions"):

- an **admission policy** (`art_trio.AdmissionPolicy`): how many rollouts may start now, which
  ready groups make a batch; passed as ``admission=``. This one caps the rollouts in flight
  and otherwise keeps the reference's rule;
- a **stage extension** (`art_trio.StageExtension`): given a `RunView` when a run starts, it
  returns a stage the trainer runs in its own task group, so it ends with the run. This one
  stops the run cleanly once the smoothed training reward reaches a target.

    python examples/extensions.py           # writes under ./.art
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402
import trio  # noqa: E402

from art_trio import (  # noqa: E402
    GateSnapshot,
    PipelineRuntimeConfig,
    PipelineTrainer,
    RunView,
    StepTrained,
    trainable_model,  # noqa: E402
)
from art_trio.demo import CpuBackend, TaskConfig, rollout, scenarios, start_over  # noqa: E402


# --8<-- [start:admission]
class InFlightCap:
    """The reference's staleness gate, and never more than `limit` rollouts at once."""

    name = "in_flight_cap"
    cancels_doomed_rollouts = False  # let a rollout past its window finish (as the reference)
    drops_stale_early = False
    gate_class = None  # the kernel's gate measures all this policy reads

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.most_in_flight = 0

    def headroom(self, s: GateSnapshot) -> float:
        running = s.in_flight or 0
        self.most_in_flight = max(self.most_in_flight, running)
        if s.policy_version < s.next_training_step - s.max_steps_off_policy:
            return 0  # every rollout started now would be too old for the coming batches
        return max(0, self.limit - running)

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        return max_batch_size

    def take_batch(self, ready: list, max_batch_size: int) -> list:
        batch = ready[:max_batch_size]  # arrival order
        del ready[:max_batch_size]
        return batch
# --8<-- [end:admission]


# --8<-- [start:stage]
class StopAtReward:
    """Stops the run (as `request_stop()` does) once the smoothed train reward reaches `target`."""

    def __init__(self, target: float) -> None:
        self.target = target
        self.stopped_at: int | None = None

    def stage(self, run: RunView) -> _Watch:
        return _Watch(self, run)


class _Watch:
    name = "stop-at-reward"

    def __init__(self, rule: StopAtReward, run: RunView) -> None:
        self.rule, self.run = rule, run
        self.smoothed = math.nan

    def _heard(self, event: object) -> None:
        if isinstance(event, StepTrained) and event.reward_mean is not None:
            r = event.reward_mean
            self.smoothed = r if math.isnan(self.smoothed) else 0.5 * self.smoothed + 0.5 * r
            if self.smoothed >= self.rule.target and self.rule.stopped_at is None:
                self.rule.stopped_at = event.step
                self.run.stop.request()

    async def __call__(self) -> None:
        remove = self.run.observe(self._heard)
        try:
            await self.run.stop.finished.wait()  # the run's end ends this stage
        finally:
            remove()
# --8<-- [end:stage]


async def main() -> None:
    model: art.TrainableModel = trainable_model(
        name="extensions", project="examples", base_model="cpu-demo"
    )
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    cap, stop_rule = InFlightCap(limit=3), StopAtReward(target=0.9)
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)
        trainer = PipelineTrainer(
            model, backend, rollout, scenarios(0), TaskConfig(),
            pipeline=PipelineRuntimeConfig(num_rollout_workers=8, min_batch_size=2),
            max_steps_off_policy=1, learning_rate=0.05, max_steps=20,
            admission=cap, extensions=[stop_rule],
        )  # fmt: skip
        await trainer.train()
    steps = trainer.statistics().steps
    print(f"8 workers, at most {cap.most_in_flight} rollouts in flight (cap {cap.limit})")
    print(f"stopped by the reward target at step {stop_rule.stopped_at}; trained {steps} steps")
    assert cap.most_in_flight <= cap.limit


if __name__ == "__main__":
    trio.run(main)
