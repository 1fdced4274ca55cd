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
