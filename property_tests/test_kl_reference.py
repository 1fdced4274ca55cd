"""The KL penalty's reference checkpoint survives retention, whatever the strategy.

With `kl_penalty_coef > 0` every `backend.train` call reads a reference checkpoint: step 0,
or `current - kl_penalty_step_lag` (floored at 0) with a lag, or art_trio's explicit
`kl_penalty_reference_step`. Hypothesis draws the KL settings, the retention strategy (keep
nothing, keep a drawn subset, keep the newest) and its interval, and runs the real trainer
against a backend double that writes a checkpoint directory per step and deletes as ART's
backends do. The property: at every `backend.train` call, and after the run for the step
that would come next, the reference checkpoint is on disk. The expected reference is
restated here from ART 0.5.23's rule, never computed with art_trio's own functions (the
mutation test in test_mutants.py replaces those with one that forgets the reference).
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
import trio  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from art_trio import CheckpointRetentionContext, PipelineTrainer, trio_native  # noqa: E402
from art_trio.plumbing.compat import PipelineRuntimeConfig, trainable_model  # noqa: E402
from art_trio.testing import checks  # noqa: E402
from art_trio.testing.doubles import BackendDouble, TrainBatch, trajectory_group  # noqa: E402

KL_REFERENCE = "kl reference"


@dataclass(frozen=True)
class KlCase:
    steps: int
    kl_penalty_step_lag: int | None
    kl_penalty_reference_step: int | None
    retention_interval: int
    #: "nothing", "newest" or "subset" (keep the steps whose `keep_mask` entry is True).
    strategy: str
    keep_mask: tuple[bool, ...]

    def reference(self, current_step: int) -> int:
        """The checkpoint `backend.train` reads when it trains from `current_step`."""
        if self.kl_penalty_reference_step is not None:
            return self.kl_penalty_reference_step
        if self.kl_penalty_step_lag is None:
            return 0
        return max(0, current_step - self.kl_penalty_step_lag)


@st.composite
def kl_cases(draw: st.DrawFn) -> KlCase:
    steps = draw(st.integers(1, 8))
    explicit = draw(st.one_of(st.none(), st.integers(0, steps - 1))) if draw(
        st.integers(0, 3)
    ) == 0 else None
    return KlCase(
        steps=steps,
        kl_penalty_step_lag=draw(st.one_of(st.none(), st.integers(1, 4))),
        kl_penalty_reference_step=explicit,
        retention_interval=draw(st.integers(1, 3)),
        strategy=draw(st.sampled_from(["nothing", "newest", "subset"])),
        keep_mask=tuple(draw(st.lists(st.booleans(), min_size=1, max_size=5))),
    )


@dataclass
class CheckpointingBackend(BackendDouble):
    """Writes `checkpoints/NNNN` for every step it trains; deletes what it is told to."""

    case: KlCase | None = None
    #: (the step trained from, its reference, whether that checkpoint was on disk then)
    references_seen: list[tuple[int, int, bool]] = field(default_factory=list)
    model_dir: Path | None = None

    def __post_init__(self) -> None:
        BackendDouble.__init__(self)

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        assert self.case is not None and self.model_dir is not None
        reference = self.case.reference(self.step)
        present = (self.model_dir / "checkpoints" / f"{reference:04d}").is_dir()
        self.references_seen.append((self.step, reference, present))

    def record(self, batch: TrainBatch) -> None:
        path = Path(batch.model._get_output_dir()) / "checkpoints" / f"{batch.step:04d}"
        path.mkdir(parents=True, exist_ok=True)

    def delete_checkpoints(self, model: Any, steps_to_keep: list[int]) -> None:
        for path in (Path(model._get_output_dir()) / "checkpoints").iterdir():
            if path.name.isdigit() and int(path.name) not in steps_to_keep:
                path.rmdir()


def strategy_for(case: KlCase) -> Any:
    def strategy(context: CheckpointRetentionContext) -> set[int]:
        steps = sorted(c.step for c in context.checkpoints)
        if case.strategy == "nothing":
            return set()
        if case.strategy == "newest":
            return set(steps[-1:])
        return {s for s in steps if case.keep_mask[s % len(case.keep_mask)]}

    return strategy


@trio_native
async def instant_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return trajectory_group([0.0, 1.0])


@dataclass
class KlResult:
    case: KlCase
    references_seen: list[tuple[int, int, bool]]
    final_step: int
    final_reference_present: bool


def run_kl_case(case: KlCase) -> KlResult:
    with tempfile.TemporaryDirectory(prefix="art_trio_kl_") as tmp:
        model = trainable_model(name="m", project="p", base_model="test-base", base_path=tmp)
        backend = CheckpointingBackend(case=case)
        asyncio.run(model.register(backend))
        out = Path(model._get_output_dir())
        backend.model_dir = out
        (out / "checkpoints" / "0000").mkdir(parents=True)  # the starting adapter
        trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
            model,
            backend,
            instant_rollout,
            [{"i": i} for i in range(3 * case.steps)],
            None,
            pipeline=PipelineRuntimeConfig(
                num_rollout_workers=1, min_batch_size=1, max_batch_size=1
            ),
            max_steps=case.steps,
            kl_penalty_coef=0.1,
            kl_penalty_step_lag=case.kl_penalty_step_lag,
            kl_penalty_reference_step=case.kl_penalty_reference_step,
            checkpoint_retention_strategy=strategy_for(case),
            checkpoint_retention_interval=case.retention_interval,
            log_interval_seconds=1e9,
        )
        trio.run(functools.partial(trainer.train, handle_signals=False))
        reference = case.reference(backend.step)
        return KlResult(
            case=case,
            references_seen=backend.references_seen,
            final_step=backend.step,
            final_reference_present=(out / "checkpoints" / f"{reference:04d}").is_dir(),
        )


def check_kl_reference(result: KlResult) -> None:
    for current, reference, present in result.references_seen:
        if reference > current:
            continue  # an explicit reference step not reached yet: no checkpoint to keep
        checks.expect(
            present,
            KL_REFERENCE,
            f"backend.train from step {current} needs the KL reference checkpoint "
            f"{reference}, and retention had deleted it ({result.case})",
        )
    checks.expect(
        result.final_reference_present
        or result.case.reference(result.final_step) > result.final_step,
        KL_REFERENCE,
        f"after the run (step {result.final_step}) the next step's KL reference "
        f"{result.case.reference(result.final_step)} was deleted ({result.case})",
    )
    checks.expect(
        result.final_step == result.case.steps,
        checks.TERMINATION,
        f"the run trained {result.final_step} steps, max_steps={result.case.steps}",
    )


def prop_kl_reference_kept(case: KlCase) -> None:
    check_kl_reference(run_kl_case(case))


@given(kl_cases())
def test_kl_reference_is_never_deleted(case: KlCase) -> None:
    """12. With a KL penalty, the reference checkpoint outlives every retention strategy."""
    prop_kl_reference_kept(case)
