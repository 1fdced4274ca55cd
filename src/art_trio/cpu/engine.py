"""Continuous batching for the CPU server: one decode loop, in one thread, for every request.

``Engine`` owns the serving copy of the model. A request (each of its ``n`` choices a row) is
prefilled alone, then joins the running batch at the next decode step; a row leaves the batch
when it samples a stop token or reaches its ``max_tokens``. Rows of every checkpoint step decode
together: each step's LoRA weights are a named peft adapter, and peft's mixed-adapter forward
(``adapter_names``, one name per row) runs the base model once for the whole batch and each
adapter's low-rank update on its own rows.

The KV cache is one ``DynamicCache`` for the batch, left-padded: every row's tokens end in the
last column, a 0/1 attention mask hides the padding and each row's position ids count only its
own tokens, so a row's logits are those it would get alone (up to float rounding). When rows
leave, the columns that are padding for every remaining row are cut off.

What you may rely on:

* Per row, sampling is ``sampling.sample_row`` with the row's own ``torch.Generator`` (seeded
  from the request's ``seed`` and the row's index): a seed gives the same tokens alone or in a
  batch.
* Caps: at most ``max_rows`` rows decode at once, and ``rows x max(prompt + max_tokens)`` over
  the batch (the left-padded cache's largest possible size, in tokens) stays within
  ``max_tokens``. A request that would pass a cap waits, first come first served; one that can
  never fit is refused by ``check`` (``RequestTooLarge``).
* ``submit`` returns a ``concurrent.futures.Future``; cancelling it aborts the request: its rows
  leave the batch before the next decode step (or it leaves the queue). ``statistics`` counts
  the work done and the work aborted.
* ``call(fn)`` runs ``fn()`` in the engine's thread between two steps (for other uses of the
  serving model, which is never touched by two threads at once).
* In-flight updates: a request with ``follow=key`` decodes with the newest weights
  ``publish(key, version, weights)`` gave: a row already decoding switches to them from its
  next token (its cache keeps the keys and values the older weights computed, as PipelineRL
  and AReaL do). Every completion says which version produced which of its tokens
  (``Completion.policy_runs``); a request without ``follow`` stays on its ``adapter``.
* A request whose rows cannot be decoded (sampling, or loading its weights, raises for one
  of them) fails alone with ``RowFailed``: its rows leave the batch and the others decode on.
* ``close`` fails every pending request with ``EngineClosed`` and stops the thread after the
  step under way.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from art_trio import ArtTrioError

from . import sampling

logger = logging.getLogger(__name__)

T = TypeVar("T")
Answer = concurrent.futures.Future[list[sampling.Completion]]

#: Adapters kept loaded with no row using them (each is a few MB for a 135M model, r=8).
IDLE_ADAPTERS = 4

_GOLDEN = 0x9E3779B97F4A7C15
_NAMES = itertools.count()  # adapter names, unique in the process


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    return None if trim is None else lambda: trim(0)


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand the heap that freed tensors left behind back to the operating system.

    A training step's activations and the engine's batch caches are tensors of ever-changing
    sizes, freed in several threads' malloc arenas, which glibc keeps mapped: without this, the
    scheduler benchmark's process on the list task grew to 10.7 GB in four steps (2.1 GB once
    trimmed). Called after every training step and whenever the engine goes idle; a no-op where
    the C library has no ``malloc_trim`` (macOS, musl).
    """
    if _TRIM is not None:
        _TRIM()


class EngineClosed(ArtTrioError, RuntimeError):
    """The engine stopped (the backend's ``async with`` block ended) before the answer."""


class RequestTooLarge(ArtTrioError, ValueError):
    """A request that could never fit the engine's caps."""


class RowFailed(ArtTrioError, RuntimeError):
    """Decoding one of the request's rows raised (the cause is chained); the engine serves on."""


def row_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (choice 0 gets ``seed``)."""
    return (seed + index * _GOLDEN) % 2**63


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One chat completion request, tokenized. ``adapter`` is the step's LoRA weights (keyed
    by the peft parameter names of the ``default`` adapter); the same object means the same
    weights, so it is loaded once however many requests use it."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_logprobs: int
    seeds: list[int]
    adapter: dict[str, torch.Tensor]
    ignore_eos: bool = False
    #: The policy version ``adapter`` holds (reported per token in ``policy_runs``).
    version: int = 0
    #: Follow the newest weights published under this key (see the module docstring).
    follow: str | None = None

    @property
    def reserve(self) -> int:
        """Tokens one of its rows may hold in the cache: its prompt and every answer token."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass(eq=False)
class _Pending:
    request: EngineRequest
    future: Answer
    rows: list[_Row] = field(default_factory=list)
    open_rows: int = 0


@dataclass(eq=False)
class _Row:
    pending: _Pending
    adapter: str
    generator: torch.Generator
    length: int  # tokens of this row in the cache
    version: int  # of the weights its next forward uses
    completion: sampling.RowSample = field(default_factory=sampling.RowSample)
    next_token: int = -1
    finish_reason: str | None = None


@dataclass
class _Adapter:
    name: str
    weights: dict[str, torch.Tensor]
    last_used: int = 0


@dataclass
class EngineStatistics:
    """Counters of the engine's work since it was made (read with ``Engine.statistics``)."""

    decode_steps: int = 0
    prefills: int = 0
    busy_seconds: float = 0.0
    tokens_generated: int = 0
    #: Tokens generated for requests that were then aborted (work nobody read).
    tokens_aborted: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    rows_running: int = 0
    requests_waiting: int = 0
    peak_rows: int = 0
    #: The largest left-padded cache seen, in tokens (rows x columns).
    peak_cache_tokens: int = 0
    #: Times a decoding row went on with newer weights (in-flight updates).
    rows_updated: int = 0
    #: Requests failed alone with ``RowFailed`` (one of their rows raised).
    requests_failed: int = 0


class Engine:
    """The decode loop (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        stop_ids: set[int],
        max_rows: int,
        max_tokens: int,
        on_busy: Callable[[float, float], None] | None = None,
    ) -> None:
        if max_rows < 1 or max_tokens < 1:
            raise ValueError("max_rows and max_tokens must be >= 1")
        self.model = model
        self.stop_ids = set(stop_ids)
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self._on_busy = on_busy
        self._lock = threading.Condition()
        self._waiting: deque[_Pending] = deque()
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._adapters: dict[int, _Adapter] = {}  # by id() of the weights dict
        self._newest: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}  # by follow key
        self._clock = itertools.count()
        self._stats = EngineStatistics()
        self._template = model.peft_config["default"]
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self._active = "default"
        #: Called in the engine thread after every decode step (tests watch progress with it).
        self.listeners: list[Callable[[EngineStatistics], None]] = []

    # ------------------------------------------------------------------ the caller's side

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._thread = threading.Thread(target=self._run, name="cpu-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Fail what is pending and stop the loop after its current step (does not wait)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self, request: EngineRequest) -> None:
        """Raise ``RequestTooLarge`` for a request no batch could ever hold."""
        if request.n > self.max_rows:
            raise RequestTooLarge(
                f"n={request.n} is more rows than this server decodes at once ({self.max_rows}):"
                " lower n, or raise CPUBackend(max_batch_rows=...)."
            )
        need = request.n * request.reserve
        if need > self.max_tokens:
            raise RequestTooLarge(
                f"n={request.n} x ({len(request.prompt_ids)} prompt + {request.max_tokens} "
                f"completion tokens) = {need} tokens is more than this server's batch holds "
                f"({self.max_tokens}): lower n or max_tokens, or raise "
                "CPUBackend(max_batch_tokens=...)."
            )

    def submit(self, request: EngineRequest) -> Answer:
        """Queue ``request``; the future gives its ``n`` completions. Cancel it to abort."""
        self.check(request)
        if len(request.seeds) != request.n:
            raise ValueError("one seed per row")
        future: Answer = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise EngineClosed("the CPU backend's server is shutting down")
            self._waiting.append(_Pending(request, future))
            self._stats.requests_waiting = len(self._waiting)
            self._lock.notify_all()
        return future

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` in the engine thread between two steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise EngineClosed("the CPU backend's server is shutting down")
            self._jobs.append((fn, future))
            self._lock.notify_all()
        return future

    def publish(self, key: str, version: int, weights: dict[str, torch.Tensor]) -> None:
        """From the next decode step on, rows following ``key`` decode with ``weights``."""
        with self._lock:
            current = self._newest.get(key)
            if current is None or version > current[0]:
                self._newest[key] = (version, weights)

    def statistics(self) -> EngineStatistics:
        """A copy of the counters."""
        with self._lock:
            return EngineStatistics(**vars(self._stats))

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        busy_since: float | None = None
        try:
            while True:
                with self._lock:
                    while not (self._closing or self._waiting or self._jobs or self._rows):
                        if busy_since is not None:
                            self._busy(busy_since)
                            busy_since = None
                            release_freed_memory()
                        self._lock.wait()
                    if self._closing:
                        break
                    jobs = list(self._jobs)
                    self._jobs.clear()
                if busy_since is None:
                    busy_since = time.monotonic()
                if jobs:
                    self._activate("default")  # what jobs expect (the backend's own weights)
                for fn, future in jobs:
                    self._run_job(fn, future)
                with torch.inference_mode():
                    self._drop_aborted()
                    self._admit()
                    if self._rows:
                        self._decode()
                for listener in list(self.listeners):
                    listener(self.statistics())
        except BaseException as exc:  # a bug or a failed forward: fail every request, loudly
            logger.exception("the CPU serving engine failed")
            self._fail_all(exc)
            raise
        finally:
            if busy_since is not None:
                self._busy(busy_since)
            self._fail_all(EngineClosed("the CPU backend's server is shutting down"))
            # The model outlives this engine (a backend serves again in its next block).
            self._activate("default")
            for adapter in self._adapters.values():
                self.model.delete_adapter(adapter.name)
            self._adapters.clear()

    def _busy(self, since: float) -> None:
        end = time.monotonic()
        self._stats.busy_seconds += end - since
        if self._on_busy is not None:
            self._on_busy(since, end)

    @staticmethod
    def _run_job(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._closing = True
            running = {id(row.pending): row.pending for row in self._rows}
            pendings = list(self._waiting) + list(running.values())
            self._waiting.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
            self._stats.requests_waiting = 0
            self._stats.rows_running = 0
        self._rows = []
        self._cache = None
        self._mask = None
        for pending in pendings:
            _settle(pending.future, exception=exc)
        for _, future in jobs:
            _settle(future, exception=exc)

    # ------------------------------------------------------------------ admission

    def _drop_aborted(self) -> None:
        with self._lock:
            for pending in [p for p in self._waiting if p.future.cancelled()]:
                self._waiting.remove(pending)
                self._stats.requests_aborted += 1
            self._stats.requests_waiting = len(self._waiting)
        keep = [i for i, row in enumerate(self._rows) if not row.pending.future.cancelled()]
        if len(keep) == len(self._rows):
            return
        gone = {id(r.pending): r.pending for r in self._rows if r.pending.future.cancelled()}
        with self._lock:
            self._stats.requests_aborted += len(gone)
            self._stats.tokens_aborted += sum(
                len(row.completion.token_ids) for p in gone.values() for row in p.rows
            )
        self._select(keep)

    def _fits(self, request: EngineRequest) -> bool:
        rows = len(self._rows) + request.n
        reserve = max([request.reserve, *(r.pending.request.reserve for r in self._rows)])
        return rows <= self.max_rows and rows * reserve <= self.max_tokens

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or not self._fits(self._waiting[0].request):
                    return
                pending = self._waiting.popleft()
                self._stats.requests_waiting = len(self._waiting)
            # The future stays pending (not "running"), so its caller can still cancel it.
            if pending.future.cancelled():
                with self._lock:
                    self._stats.requests_aborted += 1
                continue
            try:
                self._prefill(pending)
            except Exception as exc:
                self._fail_request(pending, exc)

    def _adapter_name(self, weights: dict[str, torch.Tensor]) -> str:
        """The peft adapter holding ``weights``, loaded now if it is not."""
        adapter = self._adapters.get(id(weights))
        if adapter is None or adapter.weights is not weights:
            in_use = {row.adapter for row in self._rows}
            idle = sorted(
                (a for a in self._adapters.values() if a.name not in in_use),
                key=lambda a: a.last_used,
            )
            for old in idle[: max(0, len(idle) - IDLE_ADAPTERS + 1)]:
                self._activate("default")  # peft re-activates another if the active one goes
                self.model.delete_adapter(old.name)
                del self._adapters[id(old.weights)]
            name = f"step{next(_NAMES)}"
            self.model.add_adapter(name, self._template)
            params = dict(self.model.named_parameters())
            for key, value in weights.items():
                params[key.replace(".default.", f".{name}.")].copy_(value)
            adapter = self._adapters[id(weights)] = _Adapter(name, weights)
        adapter.last_used = next(self._clock)
        return adapter.name

    def _prefill(self, pending: _Pending) -> None:
        """Run the prompt alone, sample each row's first token, and join the unfinished rows
        to the batch."""
        request = pending.request
        version, weights = request.version, request.adapter
        if request.follow is not None:
            with self._lock:
                newest = self._newest.get(request.follow)
            if newest is not None and newest[0] > version:
                version, weights = newest
        adapter = self._adapter_name(weights)
        ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        output = self._forward([adapter], input_ids=ids, use_cache=True, logits_to_keep=1)
        with self._lock:
            self._stats.prefills += 1
        logits = output.logits[0, -1, :]
        joining: list[_Row] = []
        for seed in request.seeds:
            row = _Row(
                pending=pending,
                adapter=adapter,
                generator=torch.Generator().manual_seed(seed),
                length=len(request.prompt_ids),
                version=version,
            )
            pending.rows.append(row)
            self._sample(row, logits)
            if row.finish_reason is None:
                joining.append(row)
        pending.open_rows = len(joining)
        if not joining:
            self._complete(pending)
            return
        self._join(output.past_key_values, joining)

    def _join(self, cache: Any, rows: list[_Row]) -> None:
        """Append ``rows`` (sharing the one-row prefill ``cache``) to the batch."""
        k = len(rows)
        new_len = rows[0].length
        new_mask = torch.ones(k, new_len, dtype=torch.long)
        if self._cache is None:
            for layer in cache.layers:
                layer.keys = layer.keys.expand(k, -1, -1, -1).contiguous()
                layer.values = layer.values.expand(k, -1, -1, -1).contiguous()
            self._cache, self._mask, self._rows = cache, new_mask, list(rows)
        else:
            assert self._mask is not None
            old_len = self._mask.shape[1]
            width = max(old_len, new_len)
            for old, new in zip(self._cache.layers, cache.layers, strict=True):
                old.keys = torch.cat(
                    [_left_pad(old.keys, width), _left_pad(new.keys, width).expand(k, -1, -1, -1)]
                )
                old.values = torch.cat(
                    [
                        _left_pad(old.values, width),
                        _left_pad(new.values, width).expand(k, -1, -1, -1),
                    ]
                )
            self._mask = torch.cat(
                [_left_pad_mask(self._mask, width), _left_pad_mask(new_mask, width)]
            )
            self._rows.extend(rows)
        self._note_size()

    def _note_size(self) -> None:
        with self._lock:
            self._stats.rows_running = len(self._rows)
            self._stats.peak_rows = max(self._stats.peak_rows, len(self._rows))
            if self._mask is not None:
                size = self._mask.shape[0] * self._mask.shape[1]
                self._stats.peak_cache_tokens = max(self._stats.peak_cache_tokens, size)

    # ------------------------------------------------------------------ decoding

    def _decode(self) -> None:
        self._follow_updates()
        rows = self._rows
        if not rows:
            return
        assert self._mask is not None
        ids = torch.tensor([[row.next_token] for row in rows], dtype=torch.long)
        positions = torch.tensor([[row.length] for row in rows], dtype=torch.long)
        self._mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        output = self._forward(
            [row.adapter for row in rows],
            input_ids=ids,
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = output.past_key_values
        logits = output.logits[:, -1, :]
        with self._lock:
            self._stats.decode_steps += 1
        keep, done = [], []
        failed: set[int] = set()  # id() of the requests failed in this step
        for i, row in enumerate(rows):
            row.length += 1
            if id(row.pending) in failed:
                continue
            try:
                self._sample(row, logits[i])
            except Exception as exc:
                failed.add(id(row.pending))
                self._fail_request(row.pending, exc)
                continue
            if row.finish_reason is None:
                keep.append(i)
            else:
                row.pending.open_rows -= 1
                if row.pending.open_rows == 0:
                    done.append(row.pending)
        keep = [i for i in keep if id(rows[i].pending) not in failed]
        if len(keep) < len(rows):
            self._select(keep)
        for pending in done:  # answered once out of the batch (its statistics say so)
            self._complete(pending)

    def _follow_updates(self) -> None:
        """Rows that follow a key take its newest weights before this step's forward (a
        request whose weights fail to load fails alone, its rows out of the batch)."""
        with self._lock:
            newest = dict(self._newest)
        if not newest:
            return
        updated = 0
        failed: set[int] = set()
        for row in self._rows:
            key = row.pending.request.follow
            if key is None or key not in newest or newest[key][0] <= row.version:
                continue
            if id(row.pending) in failed:
                continue
            try:
                row.adapter = self._adapter_name(newest[key][1])
            except Exception as exc:
                failed.add(id(row.pending))
                self._fail_request(row.pending, exc)
                continue
            row.version = newest[key][0]
            updated += 1
        if updated:
            with self._lock:
                self._stats.rows_updated += updated
        if failed:
            self._select([i for i, r in enumerate(self._rows) if id(r.pending) not in failed])

    def _forward(self, adapters: list[str], **inputs: Any) -> Any:
        """The model on ``inputs``, row i with adapter ``adapters[i]``.

        One adapter for all rows is made the active one; only a batch of several takes peft's
        mixed-adapter path (``adapter_names``), whose per-layer indexing cost a single row 30%
        more CPU per decode step here (0.077 s -> 0.110 s)."""
        if len(set(adapters)) == 1:
            self._activate(adapters[0])
            return self.model(**inputs)
        return self.model(**inputs, adapter_names=adapters)

    def _activate(self, name: str) -> None:
        # Set on the LoRA layers directly: peft's set_adapter would also mark the adapter
        # trainable (requires_grad), which inference tensors refuse.
        if self._active != name:
            for layer in self._lora_layers:
                layer._active_adapter = name
            self._active = name

    def _sample(self, row: _Row, logits: torch.Tensor) -> None:
        request = row.pending.request
        token = sampling.sample_row(
            row.completion,
            logits,
            temperature=request.temperature,
            top_p=request.top_p,
            top_logprobs=request.top_logprobs,
            generator=row.generator,
        )
        row.completion.note_policy(row.version)
        with self._lock:
            self._stats.tokens_generated += 1
        row.next_token = token
        if token in self.stop_ids and not request.ignore_eos:
            row.finish_reason = "stop"
        elif len(row.completion.token_ids) >= request.max_tokens:
            row.finish_reason = "length"

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep``, and cut the columns no remaining row needs."""
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            self._note_size()
            return
        assert self._mask is not None
        index = torch.tensor(keep, dtype=torch.long)
        self._rows = [self._rows[i] for i in keep]
        width = max(row.length for row in self._rows)
        cut = self._mask.shape[1] - width
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, cut:, :].contiguous()
            layer.values = layer.values[index, :, cut:, :].contiguous()
        self._mask = self._mask[index, cut:].contiguous()
        self._note_size()

    def _fail_request(self, pending: _Pending, exc: Exception) -> None:
        """Answer ``pending`` with ``RowFailed`` (the caller takes its rows out of the batch)."""
        logger.error("decoding a request failed; the engine serves on", exc_info=exc)
        failure = RowFailed(
            f"Decoding this request failed ({type(exc).__name__}: {exc}); the server goes on "
            "serving other requests."
        )
        failure.__cause__ = exc
        if _settle(pending.future, exception=failure):
            with self._lock:
                self._stats.requests_failed += 1

    def _complete(self, pending: _Pending) -> None:
        completions = [row.completion.finish(row.finish_reason or "length") for row in pending.rows]
        if _settle(pending.future, result=completions):
            with self._lock:
                self._stats.requests_completed += 1


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, heads, length, dim]`` padded with zeros on the left to ``width`` columns."""
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([pad, tensor], dim=2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def _settle(
    future: concurrent.futures.Future[Any],
    *,
    result: Any = None,
    exception: BaseException | None = None,
) -> bool:
    """Set ``future``'s outcome unless it is already settled (cancelled by its caller)."""
    try:
        if future.cancelled() or future.done():
            return False
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
        return True
    except concurrent.futures.InvalidStateError:
        return False
