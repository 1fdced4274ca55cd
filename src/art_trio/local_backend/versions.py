"""The steps a local backend serves: ART's checkpoint layout, inference names, leases.

Shared by the numpy demo's ``CpuBackend`` and the real-model ``CPUBackend``; each keeps its
own weights type ``W`` and checkpoint files, and supplies ``register`` and ``train``.

What you may rely on:

* Checkpoints are ART's layout, ``<model._get_output_dir()>/checkpoints/NNNN/``; a step counts
  as saved when its directory holds the backend's ``CHECKPOINT_FILE`` (written last, or the
  directory renamed into place, so a half-written step never counts).
* ``name@step`` is a model's inference name; ``name`` alone means its newest step.
* ``ModelVersions.versions`` holds the newest ``keep_steps`` steps in memory plus every step
  pinned by ``adapter_lease`` / ``exact_adapter_lease`` or by a request being answered
  (``pinned``); ``_delete_checkpoint_files`` never touches memory, so a step being served
  stays servable.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from .server import ServedBackend, UnknownModelError

if TYPE_CHECKING:
    from art.backend import AnyModel, AnyTrainableModel

W = TypeVar("W")


def saved_steps(checkpoint_root: Path, marker: str) -> list[int]:
    """Steps under ``checkpoint_root`` whose directory holds ``marker`` (a whole checkpoint)."""
    if not checkpoint_root.is_dir():
        return []
    return sorted(
        int(path.name)
        for path in checkpoint_root.iterdir()
        if path.name.isdigit() and (path / marker).is_file()
    )


def parse_model_name(model: str) -> tuple[str, int | None]:
    """``"name@7"`` -> ``("name", 7)``; ``"name"`` -> ``("name", None)`` (the newest step).

    Raises ``UnknownModelError`` for a step that is not a number."""
    name, _, step_text = model.rpartition("@")
    if not name:
        return model, None
    if not step_text.isdigit():
        raise UnknownModelError(model)
    return name, int(step_text)


@dataclass(kw_only=True)
class ModelVersions(Generic[W]):
    """One registered model: its newest step and the steps' weights held in memory."""

    output_dir: Path
    latest: int
    versions: dict[int, W]
    #: Steps pinned by the trainer (adapter_lease) or by a request being answered.
    pins: Counter[int] = field(default_factory=Counter)

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoint_root / f"{step:04d}"

    @contextmanager
    def pinned(self, step: int) -> Iterator[None]:
        """``step`` is not evicted inside the block."""
        self.pins[step] += 1
        try:
            yield
        finally:
            self.pins[step] -= 1
            if self.pins[step] <= 0:
                del self.pins[step]

    def evict(self, keep_steps: int) -> None:
        """Drop from memory every step but the newest ``keep_steps`` and the pinned ones."""
        newest = sorted(self.versions, reverse=True)[:keep_steps]
        keep = set(newest) | {s for s, count in self.pins.items() if count > 0}
        for step in list(self.versions):
            if step not in keep:
                del self.versions[step]


S = TypeVar("S", bound=ModelVersions)


class LocalBackend(ServedBackend, Generic[S]):
    """The ART ``Backend`` methods two local backends share: steps, names, checkpoint
    deletion and leases. Subclasses set ``CHECKPOINT_FILE``, fill ``_models`` in ``register``
    and call ``_init_versions`` in ``__init__``."""

    #: The file whose presence makes a checkpoint directory a saved step.
    CHECKPOINT_FILE: ClassVar[str]
    keep_steps: int
    _models: dict[str, S]

    def _init_versions(self, keep_steps: int) -> None:
        if keep_steps < 1:
            raise ValueError("keep_steps must be >= 1")
        self.keep_steps = keep_steps
        self._models = {}

    def _saved_steps(self, checkpoint_root: Path) -> list[int]:
        return saved_steps(checkpoint_root, self.CHECKPOINT_FILE)

    async def _get_step(self, model: AnyTrainableModel) -> int:
        state = self._models.get(model.name)
        if state is not None:
            return state.latest
        saved = self._saved_steps(Path(model._get_output_dir()) / "checkpoints")
        return saved[-1] if saved else 0

    def _model_inference_name(self, model: AnyModel, step: int | None = None) -> str:
        if step is None:
            state = self._models.get(model.name)
            step = state.latest if state is not None else 0
        return f"{model.name}@{step}"

    async def _delete_checkpoint_files(
        self, model: AnyTrainableModel, steps_to_keep: list[int]
    ) -> None:
        """Delete checkpoint directories whose step is not in ``steps_to_keep``.

        In-memory versions are not touched: a step still being served stays servable.
        """
        root = Path(model._get_output_dir()) / "checkpoints"
        keep = set(steps_to_keep)
        for step in self._saved_steps(root):
            if step not in keep:
                shutil.rmtree(root / f"{step:04d}", ignore_errors=True)

    def _lease_state(self, model: AnyTrainableModel) -> S | None:
        """The state a lease pins (None: the model is not registered, nothing to pin)."""
        return self._models.get(model.name)

    @asynccontextmanager
    async def adapter_lease(self, model: AnyTrainableModel, step: int) -> AsyncIterator[None]:
        """Keep ``model@step`` servable for the block (ART's trainer leases the step a rollout
        or eval uses)."""
        state = self._lease_state(model)
        if state is None:
            yield
            return
        try:
            with state.pinned(step):
                yield
        finally:
            state.evict(self.keep_steps)

    def exact_adapter_lease(
        self, model: AnyTrainableModel, step: int
    ) -> AbstractAsyncContextManager[None]:
        """ART 0.5.20's eval lease: requests for ``model@step`` are answered by exactly that
        step's weights here (each step is served under its own name), so it is the same
        lease."""
        return self.adapter_lease(model, step)

    def _resolve(self, model: str) -> tuple[str, S, int]:
        """``(name, state, step)`` for an inference name; raises ``UnknownModelError``."""
        name, step = parse_model_name(model)
        state = self._models.get(name)
        if state is None:
            raise UnknownModelError(model)
        return name, state, state.latest if step is None else step

    def _listed_steps(self, state: S) -> set[int]:
        """The steps ``GET /v1/models`` lists for a model: those in memory by default."""
        return set(state.versions)

    def model_names(self) -> list[str]:
        """``name@step`` for every listed step of every registered model."""
        return [
            f"{name}@{step}"
            for name, state in self._models.items()
            for step in sorted(self._listed_steps(state))
        ]
