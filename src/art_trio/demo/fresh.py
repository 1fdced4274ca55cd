"""Examples start over on every run, instead of resuming what an earlier run left.

An example's model has a fixed name (`.art/examples/models/<name>/`), and ART resumes a model
directory it finds: a second run would continue from the first run's state, train other
scenarios and print other numbers. The examples show one run from step 0, so each removes its
own earlier directory first, and says so.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def start_over(model: Any) -> None:
    """Remove what an earlier run left in `model`'s directory (checkpoints, history, resume
    state), printing one line if there was anything; the run that follows starts at step 0."""
    directory = Path(model._get_output_dir())
    if directory.exists():
        shutil.rmtree(directory)
        print(f"starting over: removed {directory} (left by an earlier run of this example)")


__all__ = ["start_over"]
