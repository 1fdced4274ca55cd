"""art_trio: ART's pipeline trainer on structured concurrency (trio and anyio).

Rollout workers, a training loop and an eval loop run as stages of one task group under a
bound on how stale the trained data may be. The public names are reachable here; each is
imported on first use (the list is `__init__.pyi`), so that `import art_trio` costs
milliseconds, not the seconds importing ART takes, and a run loads only what it uses.
"""

import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

import lazy_loader

# Importing ART fetches a model price table from the network unless told to use the copy it
# ships; a library import should not reach for the network. An explicit setting wins.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

__getattr__, __dir__, _names = lazy_loader.attach_stub(__name__, __file__)
#: What `from art_trio import *` brings: every public name but the one that needs an extra.
__all__ = [name for name in _names if name != "RayRolloutExecutor"]

try:
    __version__: str = _distribution_version("art-trio")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
