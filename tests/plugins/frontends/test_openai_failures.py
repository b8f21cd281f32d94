"""Overload and engine death on a live server: a full queue answers 503 with
Retry-After; a killed engine-core gives 503 on /health and an error to every
pending request within 5 s. This module's server is its own (the engine is killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from conftest import server_config
from serving_fakes import ServerThread


@pytest.fixture(scope="module")
def slow_server(served_model_dir):
    config = server_config(
        served_model_dir, max_num_seqs=2, max_waiting_requests=2, plugin={"fake": {"step_s": 0.02}}
    )
    server = ServerThread(config).start()
    yield server
    assert server.stop() == 0


async def test_full_queue_answers_503_with_retry_after(slow_server):
    body = {"prompt": "load", "max_tokens": 40, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=30) as http:
        responses = await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(10))
        )
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert refused, "no request was refused although the queue holds 2"
    assert len(refused) + len(served) == 10
    for response in refused:
        assert response.headers["retry-after"] == "1"
        assert "queue full" in response.json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)


async def test_killed_engine_fails_every_pending_request_within_5s(slow_server):
    base = slow_server.base_url
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
    model = (await client.models.list()).data[0].id
    started = asyncio.Event()

    async def streamed() -> BaseException | None:
        try:
            stream = await client.completions.create(
                model=model,
                prompt="a",
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                started.set()
        except openai.APIError as exc:
            return exc
        return None

    async def whole() -> BaseException | None:
        try:
            await client.completions.create(
                model=model, prompt="b", max_tokens=200, extra_body={"ignore_eos": True}
            )
        except openai.APIError as exc:
            return exc
        return None

    pending = [asyncio.create_task(streamed()), asyncio.create_task(whole())]
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.1)
    os.kill(slow_server.engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    errors = await asyncio.wait_for(asyncio.gather(*pending), 5.0)
    assert time.monotonic() - killed_at < 5.0
    assert all(isinstance(e, openai.APIError) for e in errors), errors
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        assert (await http.get("/health")).status_code == 503
        late = await http.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        assert late.status_code == 503
        assert late.json()["error"]["message"] == "the engine is not running"
    await client.close()
