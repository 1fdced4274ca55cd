"""Which backends a `PipelineTrainer` can train with: ART's checks on its `LocalBackend`.

ART's trainer refuses a LocalBackend that shares its GPUs between training and serving, and
the training options that backend cannot run while serving. The same checks, with ART's
messages verbatim (code and tests match on them), run at construction here.
"""

from __future__ import annotations

import sys
from typing import Any

from ..plumbing.compat import local_backend_is_dedicated
from .settings import PipelineSettings


def check_backend_support(backend: Any, model: Any, settings: PipelineSettings) -> None:
    """Raise ART's ValueError if `backend` is a LocalBackend the settings cannot run on."""
    # A LocalBackend instance exists only if its module was imported; checking sys.modules
    # first keeps construction free of torch for every other backend.
    local = sys.modules.get("art.local.backend")
    if local is None or not isinstance(backend, local.LocalBackend):
        return
    training = settings.training
    if not local_backend_is_dedicated(backend, model):
        raise ValueError(
            "PipelineTrainer only supports LocalBackend in dedicated mode. "
            "Shared LocalBackend pauses inference during training and is not "
            "a supported async PipelineTrainer path. Set both "
            "trainer_gpu_ids and inference_gpu_ids on the TrainableModel "
            "_internal_config to use LocalBackend with PipelineTrainer."
        )
    refusals = [
        (training.loss_fn not in {"cispo", "ppo"},
         "only supports loss_fn='cispo' or loss_fn='ppo'."),
        (training.loss_fn_config is not None, "requires loss_fn_config=None."),
        (training.adam_params is not None, "requires adam_params=None."),
    ]
    for refused, requirement in refusals:
        if refused:
            raise ValueError(f"PipelineTrainer + LocalBackend(dedicated) {requirement}")
