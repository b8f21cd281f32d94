"""The OpenAI frontend on a live loopback server, through the official ``openai`` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import API_KEY

MODEL = "ignored-by-fixture"


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model_with_its_root(live_server, client, served_model_dir):
    card = client.models.list().data[0]
    assert card.id == served_model_dir.name
    assert card.model_extra["root"] == str(served_model_dir)


def test_completion_returns_text_and_usage(client, model):
    result = client.completions.create(
        model=model, prompt="hello world", max_tokens=7, temperature=0
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7


def test_streamed_completion_matches_the_non_streamed_one(client, model):
    whole = client.completions.create(model=model, prompt="the cat", max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=model, prompt="the cat", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_streamed_and_not_agree(client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=9, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 9
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=9, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_greater_than_one_gives_n_choices_and_counts_all_tokens(client, model):
    result = client.completions.create(
        model=model, prompt="abc", max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 12
    streamed = client.completions.create(
        model=model, prompt="abc", max_tokens=4, n=3, temperature=1.0, seed=7, stream=True
    )
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(result.choices, key=lambda c: c.index)]


def test_seed_makes_sampling_reproducible(client, model):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=model, prompt="once upon", max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_string_ends_the_text_before_it(client, model):
    full = client.completions.create(model=model, prompt="stop me", max_tokens=24, temperature=0)
    text = full.choices[0].text.strip("\ufffd")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    result = client.completions.create(
        model=model, prompt="stop me", max_tokens=24, temperature=0, stop=[stop, "@@never@@"]
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full.choices[0].text[: full.choices[0].text.find(stop)]
    streamed = client.completions.create(
        model=model, prompt="stop me", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == result.choices[0].text


def test_completion_logprobs_list_each_token_with_alternatives(client, model):
    result = client.completions.create(
        model=model, prompt="hello", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) <= 3 and len(top) >= 1 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == result.choices[0].text


def test_chat_logprobs_give_top_logprobs_per_token(client, model):
    result = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_token_id_prompts_and_prompt_lists(client, model):
    by_ids = client.completions.create(
        model=model, prompt=[30, 31, 32], max_tokens=3, temperature=0
    )
    assert by_ids.usage.prompt_tokens == 3
    many = client.completions.create(
        model=model, prompt=["a b", "c d"], max_tokens=3, temperature=0
    )
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1]
    assert many.usage.completion_tokens == 6


def test_missing_or_wrong_api_key_is_refused_with_401(live_server, model):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            live_server.base_url + "/v1/completions",
            json={"model": model, "prompt": "x", "max_tokens": 1},
            headers=headers,
        )
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_health_version_and_metrics_are_served(live_server):
    assert httpx.get(live_server.base_url + "/health").status_code == 200
    assert httpx.get(live_server.base_url + "/version").json()["version"]
    metrics = httpx.get(live_server.base_url + "/metrics").text
    for name in (
        "tokenloom_num_requests_waiting", "tokenloom_num_requests_running",
        "tokenloom_kv_cache_usage_ratio", "tokenloom_prefix_cache_hit_rate",
        "tokenloom_num_preemptions_total", "tokenloom_prompt_tokens_total",
        "tokenloom_generation_tokens_total", "tokenloom_time_to_first_token_seconds_bucket",
        "tokenloom_inter_token_latency_seconds_bucket", "tokenloom_e2e_request_latency_seconds_count",
    ):  # fmt: skip
        assert name in metrics


def _metric(base_url: str, name: str, default: float | None = None) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} not in /metrics")


ABORTED = 'tokenloom_request_success_total{finished_reason="abort"}'


async def test_disconnect_mid_stream_frees_every_kv_block(live_server, model):
    base = live_server.base_url
    total = _metric(base, "tokenloom_kv_blocks_total")
    aborted_before = _metric(base, ABORTED, 0.0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": model,
        "prompt": "x " * 8,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
        for _ in range(3):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        assert _metric(base, "tokenloom_kv_blocks_free") < total  # in use
                        break  # leaving the block closes the connection mid-stream
                assert seen >= 3
    deadline = asyncio.get_running_loop().time() + 5
    while _metric(base, "tokenloom_kv_blocks_free") != total:
        assert asyncio.get_running_loop().time() < deadline, "KV blocks were not freed"
        await asyncio.sleep(0.05)
    assert _metric(base, "tokenloom_num_requests_running") == 0
    assert _metric(base, ABORTED) == aborted_before + 3  # aborted, not run to the end


async def test_disconnect_of_a_non_streamed_request_aborts_it(live_server, model):
    base = live_server.base_url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "prompt": "y", "max_tokens": 250, "ignore_eos": True}
    aborted_before = _metric(base, ABORTED, 0.0)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    deadline = asyncio.get_running_loop().time() + 5
    while _metric(base, ABORTED, 0.0) != aborted_before + 1:
        assert asyncio.get_running_loop().time() < deadline, "the request was not aborted"
        await asyncio.sleep(0.05)
    assert _metric(base, "tokenloom_num_requests_running") == 0


async def test_64_concurrent_streams_match_sequential_greedy_runs(live_server, model):
    client = openai.AsyncOpenAI(
        base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0
    )
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(64)]

    async def stream(prompt: str) -> str:
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    sequential = [await stream(p) for p in prompts]
    concurrent = await asyncio.gather(*(stream(p) for p in prompts))
    assert list(concurrent) == sequential
    assert all(concurrent)
    await client.close()
