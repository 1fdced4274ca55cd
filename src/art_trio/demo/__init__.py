"""A real RL run on a laptop CPU: a numpy policy behind an OpenAI-compatible server, trained
with ``art_trio.PipelineTrainer`` on ART's yes/no/maybe task.

Run it with ``art-trio demo`` or ``python -m art_trio.demo``. The pieces:

* ``CpuBackend`` (``backend``): the ART ``Backend``; ``async with`` it to serve the policy.
* ``task``: the scenarios, ``rollout`` and ``eval_fn``, plain ART-style asyncio code.
* ``policy``: the numpy softmax policy and its ``cispo``/``ppo`` gradient.
* ``server``: the OpenAI-compatible HTTP app.
* ``start_over`` (``fresh``): the examples' fresh start on every run.
"""

import os

# Importing ART imports litellm, which downloads a model price table unless told to use its
# bundled copy; the demo must work offline, so ask for the local copy before ART is imported.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from .backend import CpuBackend  # noqa: E402
from .fresh import start_over  # noqa: E402
from .task import TaskConfig, eval_fn, rollout, scenarios  # noqa: E402

__all__ = ["CpuBackend", "TaskConfig", "eval_fn", "rollout", "scenarios", "start_over"]
