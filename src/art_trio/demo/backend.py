"""``CpuBackend``: an ART ``Backend`` that trains and serves the numpy policy on a CPU.

Use it as an async context manager, on trio or asyncio::

    async with CpuBackend(seed=0) as backend:
        model = art.TrainableModel(name="m", project="p", base_model="cpu-demo")
        await model.register(backend)
        client = model.openai_client()   # reaches this backend's server
        ...

What you may rely on:

* Entering the context starts an OpenAI-compatible server on 127.0.0.1 (an ephemeral port
  unless ``port`` is given); leaving it stops the server and closes the port.
* The ART methods (``register``, ``_get_step``, ``train``, ``_model_inference_name``,
  ``_prepare_backend_for_training``, ``_delete_checkpoint_files``, ``close``) are plain
  coroutines that never await a loop primitive, so they run unchanged under asyncio, under
  trio, or from asyncio code bridged into trio by trio-asyncio.
* ``model@step`` is served with exactly that step's weights. The newest ``keep_steps`` steps
  are kept in memory, and so is any step leased (``adapter_lease``) or in the middle of a
  request; an older step is reloaded from its checkpoint if one was saved, else it is gone
  (404 ``model_not_found``).
* ``train`` does one Adam step of ART's ``cispo`` or ``ppo`` objective on group-normalized
  advantages, with the importance ratio against the logprobs the rollouts were sampled with,
  and returns ``art.types.LocalTrainResult`` (``step``, ``metrics``, ``checkpoint_path``).
  ``learning_rate`` is an Adam step size for a tiny softmax: think 0.05, not an LLM's 1e-5.
* Checkpoints live in ``<model._get_output_dir()>/checkpoints/NNNN/weights.npz`` (step 0 is
  written at registration). ``register`` resumes from the newest checkpoint on disk.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from art.trajectories import Trajectory, TrajectoryGroup
from art.types import LocalTrainResult, TrainSFTConfig
from openai.types.chat.chat_completion import Choice

from .policy import (
    DEFAULT_INIT_SCALE,
    TOKEN_INDEX,
    Adam,
    FloatArray,
    LossFn,
    Sample,
    content_text,
    freeze,
    group_advantages,
    initial_weights,
    policy_gradient,
    prompt_features,
)
from .server import ServedBackend, UnknownModelError, create_app

if TYPE_CHECKING:
    from art import dev
    from art.backend import AnyModel, AnyTrainableModel

#: Enough for ``max_steps_off_policy`` up to 8 plus an eval or two lagging behind training.
DEFAULT_KEEP_STEPS = 16
DEFAULT_LEARNING_RATE = 0.05
WEIGHTS_FILE = "weights.npz"


@dataclass
class _ModelState:
    """One registered model: its served versions and its optimizer."""

    output_dir: Path
    latest: int
    versions: dict[int, FloatArray]
    adam: Adam
    # Steps pinned by the trainer (adapter_lease) or by a request being answered.
    pins: Counter[int] = field(default_factory=Counter)

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoint_root / f"{step:04d}"


def _saved_steps(checkpoint_root: Path) -> list[int]:
    if not checkpoint_root.is_dir():
        return []
    return sorted(
        int(path.name)
        for path in checkpoint_root.iterdir()
        if path.name.isdigit() and (path / WEIGHTS_FILE).is_file()
    )


class CpuBackend(ServedBackend):
    """ART backend for the CPU demo. See the module docstring for the contract."""

    def __init__(
        self,
        *,
        seed: int = 0,
        keep_steps: int = DEFAULT_KEEP_STEPS,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str = "cpu-demo",
        init_scale: float = DEFAULT_INIT_SCALE,
    ) -> None:
        if keep_steps < 1:
            raise ValueError("keep_steps must be >= 1")
        self.seed = seed
        self.keep_steps = keep_steps
        self.api_key = api_key
        self.init_scale = init_scale
        self._init_serving(host, port)
        self._models: dict[str, _ModelState] = {}

    # ------------------------------------------------------------------ lifecycle

    def _make_app(self) -> Any:
        return create_app(self, seed=self.seed)

    # ------------------------------------------------------------------ ART Backend protocol

    async def register(self, model: AnyModel) -> None:
        """Load the model's newest checkpoint, or create and save step 0."""
        self._ensure_registered(model)

    def _ensure_registered(self, model: AnyModel) -> _ModelState:
        state = self._models.get(model.name)
        if state is not None:
            return state
        output_dir = Path(model._get_output_dir())
        checkpoint_root = output_dir / "checkpoints"
        saved = _saved_steps(checkpoint_root)
        if saved:
            latest = saved[-1]
            weights, adam = self._load(checkpoint_root / f"{latest:04d}")
        else:
            latest = 0
            weights = initial_weights(self.seed, self.init_scale)
            adam = Adam(shape=(weights.shape[0], weights.shape[1]))
        state = _ModelState(
            output_dir=output_dir, latest=latest, versions={latest: weights}, adam=adam
        )
        self._models[model.name] = state
        if not saved:
            self._save(state, 0, weights)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "model.json").write_text(json.dumps(model.safe_model_dump(), default=str))
        return state

    async def _get_step(self, model: AnyTrainableModel) -> int:
        state = self._models.get(model.name)
        if state is not None:
            return state.latest
        saved = _saved_steps(Path(model._get_output_dir()) / "checkpoints")
        return saved[-1] if saved else 0

    def _model_inference_name(self, model: AnyModel, step: int | None = None) -> str:
        if step is None:
            state = self._models.get(model.name)
            step = state.latest if state is not None else 0
        return f"{model.name}@{step}"

    async def _prepare_backend_for_training(
        self,
        model: AnyTrainableModel,
        config: dev.OpenAIServerConfig | None = None,
    ) -> tuple[str, str]:
        self._ensure_registered(model)
        return self.base_url, self.api_key

    async def _delete_checkpoint_files(
        self, model: AnyTrainableModel, steps_to_keep: list[int]
    ) -> None:
        """Delete checkpoint directories whose step is not in ``steps_to_keep``.

        In-memory versions are not touched: a step still being served stays servable.
        """
        root = Path(model._get_output_dir()) / "checkpoints"
        keep = set(steps_to_keep)
        for step in _saved_steps(root):
            if step not in keep:
                shutil.rmtree(root / f"{step:04d}", ignore_errors=True)

    async def train(
        self,
        model: AnyTrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        *,
        learning_rate: float = DEFAULT_LEARNING_RATE,
        loss_fn: str = "cispo",
        loss_fn_config: Mapping[str, Any] | None = None,
        normalize_advantages: bool = True,
        save_checkpoint: bool = True,
        epsilon: float | None = None,
        epsilon_high: float | None = None,
        **kwargs: Any,
    ) -> LocalTrainResult:
        """One optimizer step on ``trajectory_groups``; the new step is served at once.

        ``loss_fn_config`` may carry ``epsilon`` / ``epsilon_high`` (as may the keyword
        arguments). Other ART keyword arguments (``adam_params``, ``packed_sequence_length``,
        ``kl_penalty_coef``, ...) are accepted and ignored: a softmax has no sequences to
        pack and this demo keeps no reference policy.
        """
        if loss_fn not in ("cispo", "ppo"):
            raise ValueError(f"CpuBackend supports loss_fn 'cispo' or 'ppo', not {loss_fn!r}")
        config = dict(loss_fn_config or {})
        epsilon = config.get("epsilon", epsilon)
        epsilon_high = config.get("epsilon_high", epsilon_high)

        state = self._ensure_registered(model)
        weights = state.versions[state.latest]
        groups = list(trajectory_groups)
        samples = _samples_from_groups(groups, normalize=normalize_advantages)
        result = policy_gradient(
            weights,
            samples,
            loss_fn=cast(LossFn, loss_fn),
            epsilon=epsilon,
            epsilon_high=epsilon_high,
        )
        new_weights = state.adam.step(weights, result.grad, learning_rate) if samples else weights
        step = state.latest + 1
        state.versions[step] = new_weights
        state.latest = step
        self._evict(state)

        checkpoint_path = None
        if save_checkpoint:
            checkpoint_path = str(self._save(state, step, new_weights))
        metrics = {**result.metrics, "num_trained_tokens": float(len(samples))}
        return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=checkpoint_path)

    def _train_sft(
        self,
        model: AnyTrainableModel,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig,
        dev_config: dev.TrainSFTConfig,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """Not supported: the demo policy learns from rewards only."""
        raise NotImplementedError("CpuBackend does not do supervised fine-tuning")

    # ------------------------------------------------------------------ version pinning

    @asynccontextmanager
    async def adapter_lease(self, model: AnyTrainableModel, step: int) -> AsyncIterator[None]:
        """Keep ``model@step`` servable for the block (ART's trainer leases the step a rollout
        or eval uses)."""
        state = self._ensure_registered(model)
        state.pins[step] += 1
        try:
            yield
        finally:
            state.pins[step] -= 1
            if state.pins[step] <= 0:
                del state.pins[step]
            self._evict(state)

    def exact_adapter_lease(
        self, model: AnyTrainableModel, step: int
    ) -> AbstractAsyncContextManager[None]:
        """ART 0.5.20's eval lease: requests for ``model@step`` are answered by exactly that
        step's weights here (each step is served under its own name), so it is the same lease."""
        return self.adapter_lease(model, step)

    def _evict(self, state: _ModelState) -> None:
        newest = sorted(state.versions, reverse=True)[: self.keep_steps]
        keep = set(newest) | {s for s, count in state.pins.items() if count > 0}
        for step in list(state.versions):
            if step not in keep:
                del state.versions[step]

    # ------------------------------------------------------------------ PolicyRegistry (server)

    @contextmanager
    def checkout(self, model: str) -> Iterator[FloatArray]:
        """Weights for ``name@step`` (or ``name``: the latest), pinned while in use."""
        name, _, step_text = model.rpartition("@")
        if not name:
            name, step_text = model, ""
        state = self._models.get(name)
        if state is None or (step_text and not step_text.isdigit()):
            raise UnknownModelError(model)
        step = int(step_text) if step_text else state.latest
        weights = state.versions.get(step)
        if weights is None:
            weights = self._reload(state, step)
        state.pins[step] += 1
        try:
            yield weights
        finally:
            state.pins[step] -= 1
            if state.pins[step] <= 0:
                del state.pins[step]

    def model_names(self) -> list[str]:
        return [
            f"{name}@{step}"
            for name, state in self._models.items()
            for step in sorted(state.versions)
        ]

    # ------------------------------------------------------------------ checkpoints

    def _reload(self, state: _ModelState, step: int) -> FloatArray:
        path = state.checkpoint_dir(step)
        if step > state.latest or not (path / WEIGHTS_FILE).is_file():
            raise UnknownModelError(f"step {step}")
        weights, _ = self._load(path)
        # Not cached: an evicted step asked for again is rare (a late eval) and cheap to load.
        return weights

    @staticmethod
    def _load(path: Path) -> tuple[FloatArray, Adam]:
        with np.load(path / WEIGHTS_FILE) as data:
            weights = freeze(np.array(data["weights"], dtype=np.float64))
            adam = Adam(shape=(weights.shape[0], weights.shape[1]))
            adam.m = np.array(data["adam_m"], dtype=np.float64)
            adam.v = np.array(data["adam_v"], dtype=np.float64)
            adam.t = int(data["adam_t"])
        return weights, adam

    @staticmethod
    def _save(state: _ModelState, step: int, weights: FloatArray) -> Path:
        path = state.checkpoint_dir(step)
        path.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a crash never leaves a half-written checkpoint to resume from.
        tmp = path / f".{WEIGHTS_FILE}.tmp.npz"
        np.savez(
            tmp,
            weights=weights,
            adam_m=state.adam.m,
            adam_v=state.adam.v,
            adam_t=np.int64(state.adam.t),
        )
        tmp.replace(path / WEIGHTS_FILE)
        return path


def _samples_from_groups(groups: list[TrajectoryGroup], *, normalize: bool) -> list[Sample]:
    """The trainable tokens of a batch, with GRPO advantages per group.

    Like ART, trajectories with zero advantage are dropped, and a choice whose logprobs were
    not requested is trained as if sampled from the current policy.
    """
    samples: list[Sample] = []
    for group in groups:
        trajectories = group.trajectories
        advantages = group_advantages([t.reward for t in trajectories], normalize=normalize)
        for trajectory, advantage in zip(trajectories, advantages, strict=True):
            if advantage == 0.0:
                continue
            samples.extend(_trajectory_samples(trajectory, advantage))
    return samples


def _trajectory_samples(trajectory: Trajectory, advantage: float) -> list[Sample]:
    samples: list[Sample] = []
    history: list[Mapping[str, object]] = []
    for item in trajectory.messages_and_choices:
        if not isinstance(item, Choice):
            history.append(cast(Mapping[str, object], item))
            continue
        text = item.message.content or ""
        token_text = text.strip().lower()
        old_logprob: float | None = None
        if item.logprobs is not None and item.logprobs.content:
            first = item.logprobs.content[0]
            token_text, old_logprob = first.token, first.logprob
        token = TOKEN_INDEX.get(token_text)
        if token is not None:
            samples.append(
                Sample(
                    features=prompt_features(history),
                    token=token,
                    advantage=advantage,
                    old_logprob=old_logprob,
                )
            )
        history.append({"role": "assistant", "content": content_text(text)})
    return samples
