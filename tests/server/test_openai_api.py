"""The OpenAI-compatible API through the official `openai` client, on a live server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from radixserve.engine import Engine

PROMPT = "t5 t9 t13 t17 t21 t3 t7"


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_the_offline_engine(live, client, tiny_model_dir):
    offline = Engine(str(tiny_model_dir), dtype="float64").generate(PROMPT, {"max_new_tokens": 8})
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == offline[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 7
    live.idle_check()


def test_streaming_completion_equals_the_plain_one(live, client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    live.idle_check()


def test_chat_plain_and_streaming(live, client):
    messages = [{"role": "user", "content": "t40 t41 t42"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    stream = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in stream)
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content
    assert stream[-2].choices[0].finish_reason == "length"
    assert stream[-1].usage.total_tokens == plain.usage.total_tokens
    live.idle_check()


def test_n_choices_and_stop_strings(live, client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=3
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(c.text.split()) for c in out.choices)
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    words = full.choices[0].text.split()
    stop = " ".join(words[2:4])
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text)
    live.idle_check()


def test_second_request_with_a_shared_prefix_reports_cached_tokens(live, client):
    shared = " ".join(f"t{i}" for i in range(30, 70))
    first = client.completions.create(
        model="tiny", prompt=shared + " t1", max_tokens=2, temperature=0
    )
    second = client.completions.create(
        model="tiny", prompt=shared + " t2", max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 40
    metrics = httpx.get(f"{live.url}/metrics").text
    assert "radixserve_cache_hit_rate" in metrics and "radixserve_cached_prompt_tokens" in metrics


def test_64_concurrent_streams_match_offline_greedy(live, tiny_model_dir):
    prompts = [" ".join(f"t{(7 * i + j) % 90 + 5}" for j in range(5 + i % 7)) for i in range(64)]
    offline = Engine(str(tiny_model_dir), dtype="float64").generate(prompts, {"max_new_tokens": 12})
    aclient = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)

    async def one(prompt):
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(run_all())
    assert texts == [r.text for r in offline]
    live.idle_check()


def test_native_generate_reports_cached_tokens_and_timing(live):
    body = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 4}}
    httpx.post(f"{live.url}/generate", json=body)
    out = httpx.post(f"{live.url}/generate", json=body).json()
    assert len(out["output_ids"]) == 4
    meta = out["meta_info"]
    assert meta["cached_tokens"] == 4 and meta["ttft"] is not None and meta["e2e_latency"] > 0
    live.idle_check()


def test_flush_cache_when_idle(live):
    httpx.post(f"{live.url}/generate", json={"text": "t5 t6 t7", "sampling_params": {}})
    live.idle_check()
    out = httpx.post(f"{live.url}/flush_cache")
    assert out.status_code == 200
    assert live.engine.cache.total_size() == 0


def test_completion_logprobs(live, client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert "".join(f" {t}" for t in lp.tokens).strip() == out.choices[0].text.strip()
