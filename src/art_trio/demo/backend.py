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
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from art.trajectories import Trajectory, TrajectoryGroup
from art.types import LocalTrainResult, TrainSFTConfig
from openai.types.chat.chat_completion import Choice

from ..local_backend.server import UnknownModelError
from ..local_backend.versions import LocalBackend, ModelVersions
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
from .server import create_app

if TYPE_CHECKING:
    from art import dev
    from art.backend import AnyModel, AnyTrainableModel

#: Enough for ``max_steps_off_policy`` up to 8 plus an eval or two lagging behind training.
DEFAULT_KEEP_STEPS = 16
DEFAULT_LEARNING_RATE = 0.05
WEIGHTS_FILE = "weights.npz"


@dataclass(kw_only=True)
class _ModelState(ModelVersions[FloatArray]):
    """One registered model: its served versions and its optimizer."""

    adam: Adam


class CpuBackend(LocalBackend[_ModelState]):
    """ART backend for the CPU demo. See the module docstring for the contract."""

    CHECKPOINT_FILE = WEIGHTS_FILE

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
        self._init_versions(keep_steps)
        self.seed = seed
        self.api_key = api_key
        self.init_scale = init_scale
        self._init_serving(host, port)

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
        saved = self._saved_steps(checkpoint_root)
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

    async def _prepare_backend_for_training(
        self,
        model: AnyTrainableModel,
        config: dev.OpenAIServerConfig | None = None,
    ) -> tuple[str, str]:
        self._ensure_registered(model)
        return self.base_url, self.api_key

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
        state.evict(self.keep_steps)

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

    def _lease_state(self, model: AnyTrainableModel) -> _ModelState:
        """A lease registers the model first (registering is cheap here)."""
        return self._ensure_registered(model)

    # ------------------------------------------------------------------ PolicyRegistry (server)

    @contextmanager
    def checkout(self, model: str) -> Iterator[FloatArray]:
        """Weights for ``name@step`` (or ``name``: the latest), pinned while in use."""
        _, state, step = self._resolve(model)
        weights = state.versions.get(step)
        if weights is None:
            weights = self._reload(state, step)
        with state.pinned(step):
            yield weights

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
