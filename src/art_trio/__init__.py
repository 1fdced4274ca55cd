"""art_trio: ART's pipeline trainer on structured concurrency (trio and anyio).

Rollout workers, a training loop and an eval loop run as stages of one task group under a
bound on how stale the trained data may be. The public names are re-exported here.
"""

import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version
from typing import Any

# Importing ART fetches a model price table from the network unless told to use the copy it
# ships; a library import should not reach for the network. An explicit setting wins.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from .config.settings import (
    Evaluation,
    FreshnessSettings,
    Persistence,
    PipelineSettings,
    Shutdown,
    Sizes,
    Status,
    Training,
)
from .facade.trainer import PipelineTrainer
from .messages.errors import (
    ArtTrioError,
    AsyncioTaskCancelled,
    BackendStepError,
    CallbackNotAwaitable,
    EvalProvenanceError,
    ExecutorUnavailable,
    ForeignStateError,
    FuturePolicyError,
    LoopUnresponsive,
    ModelDirectoryError,
    ModelDirectoryLostError,
    ProfileError,
    RolloutLost,
    RolloutRejected,
    RolloutsKeepFailing,
    RunLockedError,
    RunLockLostError,
    ScenarioSourceClosed,
    StateFileError,
    StateWriteError,
)
from .messages.events import (
    BatchTaken,
    ChannelClosed,
    Collapsed,
    EmptyGroupReceived,
    EvalEnded,
    EvalStarted,
    GroupQueued,
    GroupReceived,
    HandOverBlocked,
    PolicyPublished,
    Resized,
    RolloutEnded,
    RolloutGivenBack,
    RolloutStarted,
    RunEvent,
    RunStatistics,
    ScenarioSettled,
    Stalled,
    StepTrained,
    TrainCallEnded,
    TrainCallStarted,
)
from .messages.types import ConfigT, EvalFn, RolloutFn, ScenarioT, SingleRolloutFn
from .messages.values import CallInFlight, Fate, RolloutInFlight
from .observation.fates import RunCounters
from .observation.status import StatusReporter
from .plumbing.bridge.calls import trio_native
from .plumbing.compat import PipelineAutotuneConfig, PipelineRuntimeConfig, trainable_model
from .plumbing.executor import RolloutExecutor
from .plumbing.progress import ProgressKeeper, RunProgress, ScenarioBook
from .plumbing.rollouts import make_group_rollout_fn
from .policy.admission import AdmissionPolicy, EagerAdmission
from .policy.gate_snapshot import GateSnapshot
from .policy.retention import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointInfo,
    CheckpointRetentionContext,
    CheckpointRetentionStrategy,
    keep_recent_and_top,
)
from .stages import RunView, StageExtension

try:
    #: The installed distribution's version; pyproject.toml's `version` is the one source.
    __version__: str = _distribution_version("art-trio")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


#: Extensions' public names (each documented from its own subpackage), reachable here too:
#: imported on first use, so that a run that does not use one does not load it, and not in
#: `__all__`. Never imports ray.
_EXTENSION_NAMES = {
    "AutotuneConfig": "autotune",
    "InProcessExecutor": "executors",
    "StalenessAwareAdmission": "admission",
    "RayRolloutExecutor": "executors",
    "PipelineStalled": "watchdog",
    "StallReport": "watchdog",
    "StageWait": "watchdog",
    "TaskFrame": "watchdog",
}


def __getattr__(name: str) -> Any:
    package = _EXTENSION_NAMES.get(name)
    if package is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{package}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXTENSION_NAMES))


__all__ = [
    "AdmissionPolicy",
    "ArtTrioError",
    "AsyncioTaskCancelled",
    "BackendStepError",
    "BatchTaken",
    "CallbackNotAwaitable",
    "ChannelClosed",
    "RolloutStarted",
    "RolloutEnded",
    "RolloutGivenBack",
    "HandOverBlocked",
    "EmptyGroupReceived",
    "TrainCallStarted",
    "TrainCallEnded",
    "Collapsed",
    "EvalStarted",
    "EvalEnded",
    "EagerAdmission",
    "GateSnapshot",
    "EvalProvenanceError",
    "Fate",
    "ForeignStateError",
    "FuturePolicyError",
    "GroupQueued",
    "GroupReceived",
    "LoopUnresponsive",
    "ModelDirectoryError",
    "ModelDirectoryLostError",
    "PolicyPublished",
    "Resized",
    "RolloutRejected",
    "RolloutsKeepFailing",
    "ScenarioSourceClosed",
    "RunCounters",
    "RunEvent",
    "RunLockedError",
    "RunLockLostError",
    "RunStatistics",
    "ScenarioSettled",
    "Stalled",
    # What is in flight (`RunView.rollouts_in_flight`, `RunView.calls`).
    "RolloutInFlight",
    "CallInFlight",
    "StateFileError",
    "StateWriteError",
    "StepTrained",
    "PipelineAutotuneConfig",
    "PipelineRuntimeConfig",
    "CHECKPOINT_CREATED_AT_METRIC",
    "CHECKPOINT_EVAL_COMPLETED_METRIC",
    "CHECKPOINT_SAVED_METRIC",
    "CheckpointInfo",
    "CheckpointRetentionContext",
    "CheckpointRetentionStrategy",
    "ConfigT",
    "EvalFn",
    "ExecutorUnavailable",
    "PipelineSettings",
    "ProfileError",
    "PipelineTrainer",
    # The settings' groups (`PipelineTrainer(..., sizes=Sizes(...))`).
    "Evaluation",
    "FreshnessSettings",
    "Persistence",
    "Shutdown",
    "Sizes",
    "Status",
    "Training",
    "RolloutExecutor",
    # The protocols extensions plug in through (docs/architecture.md).
    "ProgressKeeper",
    "RunProgress",
    "RunView",
    "ScenarioBook",
    "StageExtension",
    "RolloutFn",
    "RolloutLost",
    "ScenarioT",
    "SingleRolloutFn",
    "StatusReporter",
    "keep_recent_and_top",
    "make_group_rollout_fn",
    "trainable_model",
    "trio_native",
]
