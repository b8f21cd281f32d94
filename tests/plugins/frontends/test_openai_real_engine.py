"""The whole default stack, real engine included (tiny random llama on the CPU):
streamed and whole answers agree, 64 concurrent greedy streams equal sequential runs,
a disconnect frees every KV block, and ZeroMQ jobs stream and abort."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import server_config
from serving_fakes import ServerThread

from tokenloom.client import AsyncJobClient
from tokenloom.protocols.jobs import JobDone, JobOutput
from tokenloom.protocols.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_server(served_model_dir):
    server = ServerThread(server_config(served_model_dir), engine_factory=None).start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def model(real_server) -> str:
    return httpx.get(real_server.base_url + "/v1/models").json()["data"][0]["id"]


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_streamed_and_whole_chat_agree_with_usage(real_server, model):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens <= 8


async def test_64_concurrent_greedy_streams_equal_sequential_runs(real_server, model):
    client = openai.AsyncOpenAI(base_url=real_server.base_url + "/v1", api_key="-", max_retries=0)
    prompts = [f"request {i}: " + "word " * (i % 7) for i in range(64)]

    async def stream(prompt: str) -> str:
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    concurrent = await asyncio.gather(*(stream(p) for p in prompts))
    sequential = [await stream(p) for p in prompts]
    assert list(concurrent) == sequential
    await client.close()


async def test_disconnect_mid_stream_returns_every_kv_block(real_server, model):
    base = real_server.base_url
    total = _metric(base, "tokenloom_kv_blocks_total")
    body = {"model": model, "prompt": "abc " * 30, "max_tokens": 150, "stream": True}
    body["ignore_eos"] = True
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                assert _metric(base, "tokenloom_kv_blocks_free") < total
                break  # leaving the block closes the connection mid-stream
    deadline = asyncio.get_running_loop().time() + 5
    while _metric(base, "tokenloom_kv_blocks_free") != total:
        assert asyncio.get_running_loop().time() < deadline, "KV blocks were not freed"
        await asyncio.sleep(0.05)
    assert _metric(base, "tokenloom_num_requests_running") == 0


async def test_zmq_job_streams_and_aborts(real_server):
    async with AsyncJobClient(real_server.zmq_endpoint) as client:
        result = await client.generate("hello", SamplingParams(max_tokens=5, temperature=0))
        assert result.num_generated_tokens <= 5 and result.finish_reasons[0] in ("length", "stop")
        job = await client.submit("long", SamplingParams(max_tokens=200, ignore_eos=True))
        messages = []
        async for message in client.stream(job):
            messages.append(message)
            if len(messages) == 1:
                await client.abort(job)
        outputs = [m for m in messages if isinstance(m, JobOutput)]
        assert outputs[-1].finish_reason == "abort"
        assert isinstance(messages[-1], JobDone) and messages[-1].num_generated_tokens < 200
