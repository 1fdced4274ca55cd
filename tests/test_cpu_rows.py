"""One request cannot end serving (issue 51, item 2): tiny temperatures and top_p sample
greedily, and a row whose decoding raises fails its own request alone.

On a real, tiny transformers model (``tests/tiny_llm.py``) served by ``CPUBackend``'s real HTTP
server and reached with the real openai client. The engine is held in its step listener (a
threading event), never timed with sleeps. Skipped without the llm extra; not marked ``llm``.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from art_trio.plumbing.compat import trainable_model
from tests.tiny_llm import TINY_MARKS, tiny_model_dir

pytestmark = TINY_MARKS

PROMPT: list[dict[str, Any]] = [{"role": "user", "content": "respond with yes, no, maybe"}]
#: A prompt whose greedy continuation's largest logit, at its 28th token, is 1.24 x its first
#: token's (found by trying the corpus' word pairs on the tiny model).
RISING: list[dict[str, Any]] = [{"role": "user", "content": "system respond"}]
RISING_TOKENS = 30
#: float32's largest number times 1.2e-37: logits beyond +-40.8 overflow ``logits / 1.2e-37``.
OVERFLOW_AT = 3.4028234663852886e38 * 1.2e-37


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model with its served copy's output layer scaled so that, decoding RISING
    greedily, the first token's logits stay below 40.8 and a later token's go beyond (as
    SmolLM2's logits, in the tens, can): at temperature 1.2e-37 the prefill samples and a
    decode step overflows. (Scaling the layer keeps every argmax, so the greedy
    continuation is the same.)"""
    import torch

    from art_trio.cpu import CPUBackend
    from art_trio.cpu.sampling import prompt_token_ids

    backend = CPUBackend(tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))
    backend._load()
    model = backend._serve_model
    ids = torch.tensor([prompt_token_ids(backend._tokenizer, RISING)])
    peaks = []
    with torch.inference_mode():
        for _ in range(RISING_TOKENS):
            logits = model(input_ids=ids).logits[0, -1]
            peaks.append(float(logits.max()))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        first, later = peaks[0], max(peaks[1:])
        assert first < later, f"the tiny model's first logit is its largest: {peaks}"
        model.get_output_embeddings().weight.mul_(OVERFLOW_AT / (first * later) ** 0.5)
    yield backend


Served = tuple[Any, openai.AsyncOpenAI, str]


@pytest.fixture
async def served(backend: Any, tmp_path: Path) -> AsyncIterator[Served]:
    """``(backend, client, model name)`` with the server up; the client never retries (a
    500 is seen as it is)."""
    async with backend:
        model = trainable_model(
            name=tmp_path.name[-20:], project="p", base_model="tiny", base_path=str(tmp_path)
        )
        await model.register(backend)
        async with openai.AsyncOpenAI(
            base_url=backend.base_url, api_key=backend.api_key, max_retries=0
        ) as client:
            yield backend, client, model.get_inference_name(0)


def _tokens(completion: Any) -> list[list[int]]:
    return [list(choice.model_extra["token_ids"]) for choice in completion.choices]


def test_sampling_at_a_temperature_or_top_p_past_float32_is_the_argmax() -> None:
    import torch

    from art_trio.cpu.sampling import NonFiniteLogits, RowSample, sample_row

    logits = torch.tensor([3.0, 50.0, 49.9, -60.0, 0.0])
    for temperature, top_p in [(1.2e-37, 1.0), (5e-324, 1.0), (1e-39, 0.9), (1.0, 5e-324)]:
        for seed in range(20):
            out = RowSample()
            token = sample_row(
                out, logits, temperature=temperature, top_p=top_p, top_logprobs=2,
                generator=torch.Generator().manual_seed(seed),
            )
            assert token == 1, (temperature, top_p, seed)
            assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    with pytest.raises(NonFiniteLogits):
        sample_row(
            RowSample(), torch.tensor([1.0, float("nan")]), temperature=1.0, top_p=1.0,
            top_logprobs=0, generator=torch.Generator(),
        )


async def test_tiny_temperatures_and_top_p_are_answered_greedily_and_serving_goes_on(
    served: Served,
) -> None:
    """1.2e-37 and 5e-324 are valid temperatures (OpenAI takes 0 to 2), 5e-324 a valid top_p.
    At 1.2e-37 a decode step's logits overflowed float32 and sampling raised in the decode
    loop, which killed the engine thread: every later request got a 503. At 5e-324 the first
    token's sampling raised (a 500)."""
    backend, client, name = served
    ask: dict[str, Any] = dict(
        model=name, messages=RISING, max_tokens=RISING_TOKENS, n=2, logprobs=True,
        extra_body={"ignore_eos": True},
    )
    greedy = await client.chat.completions.create(temperature=0.0, **ask)
    assert len(set(map(tuple, _tokens(greedy)))) == 1
    for sampling in ({"temperature": 1.2e-37}, {"temperature": 5e-324}, {"top_p": 5e-324}):
        tiny = await client.chat.completions.create(**sampling, **ask)
        assert _tokens(tiny) == _tokens(greedy), sampling
    after = await client.chat.completions.create(model=name, messages=PROMPT, max_tokens=3)
    assert after.usage is not None and after.usage.completion_tokens >= 1
    assert backend.statistics()["requests_failed"] == 0


async def test_a_row_that_raises_fails_its_request_alone(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling raises for the second row of one request at its third token, while another
    request decodes in the same batch: that request gets a 500 naming the error, the other
    is answered in full, and so is a request sent afterwards."""
    from art_trio.cpu import engine, sampling

    backend, client, name = served
    serving = backend._engine
    doomed = engine.row_seed(666, 1)
    real_sample_row = sampling.sample_row

    def sample_row(out: Any, logits: Any, **kwargs: Any) -> int:
        if kwargs["generator"].initial_seed() == doomed and len(out.token_ids) == 2:
            raise ValueError("a row that cannot be sampled")
        return real_sample_row(out, logits, **kwargs)

    # The long request decodes no further than its second token until the doomed one is
    # queued (the engine's thread waits in its step listener), so both share a batch.
    queued = threading.Event()
    real_submit = serving.submit

    def submit(request: Any) -> Any:
        future = real_submit(request)
        if doomed in request.seeds:
            queued.set()
        return future

    # ... and the doomed one is sent only once the long one decodes: sent at once, it could
    # reach the server first and fail alone before the long one joined.
    decoding = threading.Event()

    def hold(stats: Any) -> None:
        if stats.tokens_generated >= 1:
            decoding.set()
        if stats.tokens_generated >= 2:
            queued.wait(120)  # a guard against a hang, not a timing assertion

    monkeypatch.setattr(sampling, "sample_row", sample_row)
    monkeypatch.setattr(serving, "submit", submit)
    serving.listeners.append(hold)
    results: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def long() -> None:
            results["long"] = await client.chat.completions.create(
                model=name, messages=PROMPT, max_tokens=40, extra_body={"ignore_eos": True}
            )

        nursery.start_soon(long)
        assert await trio.to_thread.run_sync(decoding.wait, 120)
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model=name, messages=PROMPT, n=2, max_tokens=20, seed=666,
                extra_body={"ignore_eos": True},
            )
        assert "a row that cannot be sampled" in info.value.message
    # Both shared the batch when the row failed (the long one held at its second token until
    # the doomed one was queued), and the long one decoded on to its end.
    assert results["long"].usage.completion_tokens == 40
    after = await client.chat.completions.create(model=name, messages=PROMPT, max_tokens=3)
    assert after.usage is not None and after.usage.completion_tokens >= 1
    stats = backend.statistics()
    assert stats["requests_failed"] == 1 and stats["peak_rows"] >= 3
    assert serving._thread.is_alive()
