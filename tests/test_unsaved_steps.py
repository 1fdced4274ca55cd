"""Steps trained without a checkpoint, then a restart: nothing lost, nothing trained twice.

ART's trainers ask `backend.train` for a checkpoint only at eval steps. A backend that
honours `save_checkpoint=False` (the demo's `CpuBackend`, as ART's Tinker backend) comes back
from a restart at its last checkpoint, without the steps after it. Their scenarios must be
rolled again: the resumed run trains them, and nothing the backend kept is trained twice.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import art
import pytest

from art_trio import PipelineTrainer, StepTrained, trainable_model
from art_trio.demo import CpuBackend, TaskConfig, rollout
from art_trio.resume.store import StateStore


def _scenarios() -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}: yes, no or maybe?", "seed": i} for i in range(200)]


async def _eval(model: art.TrainableModel, step: int, config: TaskConfig) -> list[Any]:
    return [art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0)]


def _run(base: Path, until_step: int) -> dict[int, list[int]]:
    """Train up to `until_step` (eval, so checkpoint, every 3rd step); what each step
    trained, by step."""
    trained: dict[int, list[int]] = {}

    async def main() -> None:
        model = trainable_model(
            name="unsaved", project="p", base_model="cpu-demo", base_path=str(base)
        )
        async with CpuBackend(seed=0) as backend:
            await model.register(backend)
            start = await backend._get_step(model)
            trainer = PipelineTrainer(
                model, backend, rollout, _scenarios(), TaskConfig(), _eval,
                num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
                max_steps=until_step - start, eval_every_n_steps=3,
            )  # fmt: skip

            def observe(event: object) -> None:
                if isinstance(event, StepTrained):
                    trained[event.step] = list(event.scenario_indices)

            trainer.add_observer(observe)
            await trainer.train(handle_signals=False)

    anyio.run(main, backend="asyncio")
    return trained


def test_steps_the_backend_did_not_checkpoint_are_trained_again_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _run(tmp_path, until_step=5)
    assert sorted(first) == [1, 2, 3, 4, 5]
    state = StateStore(next(tmp_path.rglob("models/unsaved"))).read()
    assert state is not None and [b.step for b in state.ledger.unsaved] == [4, 5]

    second = _run(tmp_path, until_step=7)
    # The backend came back at step 3 (its last checkpoint): steps 4 and 5 were lost.
    assert sorted(second) == [4, 5, 6, 7]
    assert "rolled again" in caplog.text
    lost = {i for step in (4, 5) for i in first[step]}
    kept = [i for step in (1, 2, 3) for i in first[step]]
    retrained = [i for indices in second.values() for i in indices]
    assert lost <= set(retrained), "a scenario of a lost step was never trained again"
    twice = [i for i, n in Counter(kept + retrained).items() if n > 1]
    assert not twice, f"trained twice in the backend's history: {twice}"


@pytest.mark.parametrize(
    ("unsaved", "says"),
    [
        ([{"step": 4, "scenario_indices": [0]}], "below the watermark"),
        ([{"step": 4}], "`unsaved_batches` must be"),
        ([{"step": i, "scenario_indices": []} for i in range(65)], "at most 64"),
        ({"step": 4}, "`unsaved_batches` must be"),
    ],
)
def test_a_hostile_unsaved_batches_field_is_refused(unsaved: Any, says: str) -> None:
    from art_trio.messages.errors import StateFileError
    from art_trio.resume.state import PipelineState

    with pytest.raises(StateFileError, match=says):
        PipelineState.from_json({"scenario_offset": 10**7, "unsaved_batches": unsaved})
