"""The online autotuner: the cheapest worker count that keeps the trainer fed.

`policy.py` decides (pure: statistics in, decisions out; its docstring explains the search),
`window.py` measures what it decides from, `profile.py` reads ART's `autotune=` config and
saves and loads the tuned settings, `stage.py` runs the policy in a live `train()`.

The trainer composes it when `autotune=` is given: `start_sizes` gives the sizes a tuned run
starts from, and `Autotuner` (a `StageExtension`) runs the stage when the mode is "online".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..stages import RunView
from .profile import AutotuneConfig, policy_for, profile_path, start_sizes
from .stage import AutotuneStage

__all__ = ["AutotuneConfig", "Autotuner", "start_sizes"]


@dataclass(eq=False)
class Autotuner:
    """Runs the online autotuner beside a run's stages (ART's `autotune=` config)."""

    config: Any
    #: The most workers the rollout executor can host (None: no limit).
    max_workers: int | None = None
    _stage: AutotuneStage | None = field(default=None, init=False)

    def stage(self, run: RunView) -> AutotuneStage | None:
        if getattr(self.config, "mode", "off") != "online":
            return None
        sizes = run.settings().sizes
        policy = policy_for(self.config, {
            "num_rollout_workers": sizes.num_rollout_workers,
            "min_batch_size": sizes.min_batch_size, "max_batch_size": sizes.max_batch_size,
        })
        if self.max_workers is not None:
            policy.max_workers = min(policy.max_workers, self.max_workers)
        policy.max_steps = run.settings().shutdown.max_steps
        bound = run.settings().freshness.max_steps_off_policy
        if bound is not None:
            # A rollout of policy v is trained by step v + bound at the latest: after that
            # many steps and one more, no group of the pool before a decrease is left.
            policy.skip_steps_after_decrease = bound + 1
        self._stage = AutotuneStage(
            policy=policy, config=self.config, model=run.model, settings=run.settings,
            stop=run.stop, observe=run.observe, status=run.status,
            statistics=run.statistics, resize=run.resize,
            profile=profile_path(
                run.model._get_output_dir(), getattr(self.config, "output_name", None)
            ),
        )
        return self._stage

    def resized(self, **sizes: int | None) -> None:
        """The user resized the run: the values they set are theirs from now on."""
        if self._stage is not None:
            self._stage.resized(**sizes)
