"""What type checkers and editors read for `art_trio`: every public name and where it lives.

At run time `__init__.py` reads these imports (lazy_loader) and imports each name's module on
first use, so `import art_trio` (and `art-trio --help`) loads neither ART nor the scheduler.
A name is added here, in this one place, and documented in docs/api.md.
"""

from .admission import StalenessAwareAdmission as StalenessAwareAdmission
from .autotune import AutotuneConfig as AutotuneConfig
from .config.settings import Evaluation as Evaluation
from .config.settings import FreshnessSettings as FreshnessSettings
from .config.settings import Persistence as Persistence
from .config.settings import PipelineSettings as PipelineSettings
from .config.settings import Shutdown as Shutdown
from .config.settings import Sizes as Sizes
from .config.settings import Status as Status
from .config.settings import Training as Training
from .executors import InProcessExecutor as InProcessExecutor
from .executors.ray import RayRolloutExecutor as RayRolloutExecutor
from .facade.trainer import PipelineTrainer as PipelineTrainer
from .messages.errors import ArtTrioError as ArtTrioError
from .messages.errors import AsyncioTaskCancelled as AsyncioTaskCancelled
from .messages.errors import BackendStepError as BackendStepError
from .messages.errors import CallbackNotAwaitable as CallbackNotAwaitable
from .messages.errors import EvalProvenanceError as EvalProvenanceError
from .messages.errors import ExecutorUnavailable as ExecutorUnavailable
from .messages.errors import ForeignStateError as ForeignStateError
from .messages.errors import FuturePolicyError as FuturePolicyError
from .messages.errors import LoopUnresponsive as LoopUnresponsive
from .messages.errors import ModelDirectoryError as ModelDirectoryError
from .messages.errors import ModelDirectoryLostError as ModelDirectoryLostError
from .messages.errors import ProfileError as ProfileError
from .messages.errors import RolloutLost as RolloutLost
from .messages.errors import RolloutRejected as RolloutRejected
from .messages.errors import RolloutsKeepFailing as RolloutsKeepFailing
from .messages.errors import RunLockedError as RunLockedError
from .messages.errors import RunLockLostError as RunLockLostError
from .messages.errors import ScenarioSourceClosed as ScenarioSourceClosed
from .messages.errors import StateFileError as StateFileError
from .messages.errors import StateWriteError as StateWriteError
from .messages.events import BatchTaken as BatchTaken
from .messages.events import ChannelClosed as ChannelClosed
from .messages.events import Collapsed as Collapsed
from .messages.events import EmptyGroupReceived as EmptyGroupReceived
from .messages.events import EvalEnded as EvalEnded
from .messages.events import EvalStarted as EvalStarted
from .messages.events import GroupQueued as GroupQueued
from .messages.events import GroupReceived as GroupReceived
from .messages.events import HandOverBlocked as HandOverBlocked
from .messages.events import PolicyPublished as PolicyPublished
from .messages.events import Resized as Resized
from .messages.events import RolloutEnded as RolloutEnded
from .messages.events import RolloutGivenBack as RolloutGivenBack
from .messages.events import RolloutStarted as RolloutStarted
from .messages.events import RunEvent as RunEvent
from .messages.events import RunStatistics as RunStatistics
from .messages.events import ScenarioSettled as ScenarioSettled
from .messages.events import Stalled as Stalled
from .messages.events import StepTrained as StepTrained
from .messages.events import TrainCallEnded as TrainCallEnded
from .messages.events import TrainCallStarted as TrainCallStarted
from .messages.types import ConfigT as ConfigT
from .messages.types import EvalFn as EvalFn
from .messages.types import RolloutFn as RolloutFn
from .messages.types import ScenarioT as ScenarioT
from .messages.types import SingleRolloutFn as SingleRolloutFn
from .messages.values import CallInFlight as CallInFlight
from .messages.values import Fate as Fate
from .messages.values import RolloutInFlight as RolloutInFlight
from .observation.fates import RunCounters as RunCounters
from .observation.status import StatusReporter as StatusReporter
from .plumbing.bridge.calls import trio_native as trio_native
from .plumbing.compat import PipelineAutotuneConfig as PipelineAutotuneConfig
from .plumbing.compat import PipelineRuntimeConfig as PipelineRuntimeConfig
from .plumbing.compat import trainable_model as trainable_model
from .plumbing.executor import RolloutExecutor as RolloutExecutor
from .plumbing.progress import ProgressKeeper as ProgressKeeper
from .plumbing.progress import RunProgress as RunProgress
from .plumbing.progress import ScenarioBook as ScenarioBook
from .plumbing.rollouts import make_group_rollout_fn as make_group_rollout_fn
from .policy.admission import AdmissionPolicy as AdmissionPolicy
from .policy.admission import EagerAdmission as EagerAdmission
from .policy.gate_snapshot import GateSnapshot as GateSnapshot
from .policy.retention import CHECKPOINT_CREATED_AT_METRIC as CHECKPOINT_CREATED_AT_METRIC
from .policy.retention import CHECKPOINT_EVAL_COMPLETED_METRIC as CHECKPOINT_EVAL_COMPLETED_METRIC
from .policy.retention import CHECKPOINT_SAVED_METRIC as CHECKPOINT_SAVED_METRIC
from .policy.retention import CheckpointInfo as CheckpointInfo
from .policy.retention import CheckpointRetentionContext as CheckpointRetentionContext
from .policy.retention import CheckpointRetentionStrategy as CheckpointRetentionStrategy
from .policy.retention import keep_recent_and_top as keep_recent_and_top
from .stages import RunView as RunView
from .stages import StageExtension as StageExtension
from .watchdog import PipelineStalled as PipelineStalled
from .watchdog import StageWait as StageWait
from .watchdog import StallReport as StallReport
from .watchdog import TaskFrame as TaskFrame

#: The installed distribution's version (pyproject.toml's `version` is the one source).
__version__: str
