from __future__ import annotations

import json
from pathlib import Path

import anyio
import trio

from art_trio import PipelineTrainer
from tests.doubles import asyncio_rollout, scenarios


async def test_runs_under_trio(model, backend):
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(20), None,
        num_rollout_workers=4, min_batch_size=2, max_batch_size=4, max_steps=3,
    )
    await trainer.train(handle_signals=False)
    assert backend.step == 3
    out = Path(model._get_output_dir())
    assert (out / "trajectories" / "train" / "0001.parquet").exists()
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert any("train/reward" in r for r in rows)
