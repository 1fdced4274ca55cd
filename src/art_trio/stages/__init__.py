"""The pipeline's stages, all of one shape: a `Stage`.

A stage is an object built with the collaborators it uses (the trainer hands it the gate,
the fate record, the clock, ... of the run, never the run itself), whose `__call__` runs its
loop and owns its end of a stream; `name` labels its errors (supervision.py). What a stage
counts goes out as events (the counters fold them). The trainer starts each in the run's task
group.
"""

from __future__ import annotations

from typing import Protocol


class Stage(Protocol):
    """What the trainer needs of every stage."""

    #: The stage's name, as errors are labelled ("raised in art_trio's rollout stage").
    name: str

    async def __call__(self) -> None:
        """Run until the run ends (or the stage's own work is done)."""
