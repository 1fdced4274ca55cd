"""The status stage: prints the periodic `[status]` line until the run finishes.

It sleeps until the next line is due or the run finishes, whichever comes first, so it costs
nothing between lines and never delays the end of a run.
"""

from __future__ import annotations

import anyio

from ..run import PipelineRun


class StatusStage:
    """Prints the `[status]` line every `log_interval_seconds` (the reporter folds the
    events; this stage only decides when to print)."""

    name = "status"

    def __init__(self, run: PipelineRun) -> None:
        self.status = run.status
        self.start_step = run.start_step
        self.finished = run.stop.finished

    async def __call__(self) -> None:
        status, finished = self.status, self.finished
        status.start(initial_step=self.start_step)
        try:
            while not finished.is_set():
                status.log_if_due()
                with anyio.move_on_after(status.seconds_until_log()):
                    await finished.wait()
        finally:
            status.flush()
            status.close()
