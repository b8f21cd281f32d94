"""``tokenloom.client``: the sync and async job clients against a live zmq frontend."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins" / "frontends"))
from serving_fakes import ServerThread  # noqa: E402

from tokenloom.client import AsyncJobClient, JobClient, JobFailed  # noqa: E402
from tokenloom.config import make_config  # noqa: E402
from tokenloom.protocols.jobs import JobDone, JobOutput  # noqa: E402
from tokenloom.protocols.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def requests_log(tmp_path_factory):
    return tmp_path_factory.mktemp("fake") / "requests.jsonl"


@pytest.fixture(scope="module")
def endpoint(tiny_model_factory, requests_log):
    config = make_config(
        {
            "model": str(tiny_model_factory("llama")),
            "frontends": ["zmq"],
            "zmq_endpoint": "tcp://127.0.0.1:*",
            "max_model_len": 256,
            "plugin": {"fake": {"step_s": 0.005, "requests_log": str(requests_log)}},
        }
    )
    server = ServerThread(config).start()
    yield server.zmq_endpoint
    assert server.stop() == 0


def test_sync_client_submits_and_streams_a_job(endpoint):
    with JobClient(endpoint) as client:
        assert client.ping()
        job = client.submit("hello", GREEDY)
        messages = list(client.stream(job))
    outputs = [m for m in messages if isinstance(m, JobOutput)]
    assert isinstance(messages[-1], JobDone)
    assert sum(len(o.token_ids) for o in outputs) == 8
    assert outputs[-1].finish_reason == "length"


def test_sync_generate_is_deterministic_for_text_and_token_prompts(endpoint):
    with JobClient(endpoint) as client:
        first = client.generate("same prompt", GREEDY)
        second = client.generate("same prompt", GREEDY)
        by_ids = client.generate([30, 31, 32], SamplingParams(n=2, max_tokens=3, temperature=0))
    assert first.text == second.text and first.token_ids == second.token_ids
    assert first.num_generated_tokens == 8
    assert by_ids.num_prompt_tokens == 3 and len(by_ids.texts) == 2
    assert by_ids.finish_reasons == ["length", "length"]


def test_sync_client_interleaves_jobs_and_aborts_one(endpoint):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    with JobClient(endpoint) as client:
        slow = client.submit([40, 41], long)
        fast = client.submit([42], SamplingParams(max_tokens=3))
        assert isinstance(list(client.stream(fast))[-1], JobDone)
        client.abort(slow)
        messages = list(client.stream(slow))
    reasons = [m.finish_reason for m in messages if isinstance(m, JobOutput) and m.finish_reason]
    assert reasons == ["abort"]
    assert messages[-1].num_generated_tokens < 200


def test_refused_job_raises_job_failed(endpoint):
    with JobClient(endpoint) as client, pytest.raises(JobFailed) as info:
        client.generate([10**9], GREEDY)
    assert info.value.code == 400


async def test_async_client_runs_jobs_concurrently_and_aborts(endpoint):
    async with AsyncJobClient(endpoint) as client:
        assert await client.ping()
        results = await asyncio.gather(*(client.generate(f"p{i}", GREEDY) for i in range(8)))
        assert all(r.num_generated_tokens == 8 for r in results)
        again = await client.generate("p3", GREEDY)
        assert again.token_ids == results[3].token_ids
        job = await client.submit([50], SamplingParams(max_tokens=200, ignore_eos=True))
        seen = []
        async for message in client.stream(job):
            seen.append(message)
            if len(seen) == 2:
                await client.abort(job)
        assert isinstance(seen[-1], JobDone) and seen[-1].num_generated_tokens < 200
        with pytest.raises(JobFailed):
            await client.generate("x" * 3000, SamplingParams(max_tokens=250))


async def test_async_stream_aborts_only_jobs_left_before_they_finish(endpoint):
    async with AsyncJobClient(endpoint) as client:
        aborted: list[str] = []
        real_abort = client.abort

        async def counting_abort(job_id: str) -> None:
            aborted.append(job_id)
            await real_abort(job_id)

        client.abort = counting_abort  # type: ignore[method-assign]
        await asyncio.gather(*(client.generate(f"p{i}", GREEDY) for i in range(4)))
        await asyncio.sleep(0.05)  # let the loop finalize the finished streams
        assert aborted == [], "finished jobs must not be aborted"
        job = await client.submit([50], SamplingParams(max_tokens=200, ignore_eos=True))
        stream = client.stream(job)
        async for message in stream:
            assert isinstance(message, JobOutput)
            break
        await stream.aclose()
        assert aborted == [job]
        result = await asyncio.wait_for(client.generate("p1", GREEDY), 10)
        assert result.num_generated_tokens == 8


def test_sync_stream_aborts_only_jobs_left_before_they_finish(endpoint):
    with JobClient(endpoint) as client:
        aborted: list[str] = []
        real_abort = client.abort
        client.abort = lambda job_id: (aborted.append(job_id), real_abort(job_id))[1]  # type: ignore[method-assign]
        client.generate("p0", GREEDY)
        assert aborted == []
        job = client.submit([50], SamplingParams(max_tokens=200, ignore_eos=True))
        stream = client.stream(job)
        assert isinstance(next(stream), JobOutput)
        stream.close()
        assert aborted == [job]
        assert client.generate("p1", GREEDY).num_generated_tokens == 8


def _engine_request(requests_log, job_id: str) -> dict:  # type: ignore[no-untyped-def]
    """The engine request of job ``job_id`` (its request id is job-SESSION-JOB_ID)."""
    lines = [json.loads(line) for line in requests_log.read_text().splitlines()]
    (line,) = [line for line in lines if line["request_id"].endswith("-" + job_id)]
    return line


def _check_metrics(result) -> None:  # type: ignore[no-untyped-def]
    metrics = result.metrics
    assert metrics is not None
    assert abs(metrics.arrival_time - time.time()) < 60
    assert 0 <= metrics.queue_time <= metrics.time_to_first_token <= metrics.e2e_time < 60
    assert metrics.time_to_first_token > 0  # a token came, after at least one fake step


def test_sync_client_sends_tenant_metadata_and_returns_metrics(endpoint, requests_log):
    with JobClient(endpoint) as client:
        plain = client.generate("plain", GREEDY)
        job = client.submit(
            "tagged", GREEDY, priority=3, tenant="alice", metadata={"team": "x"},
            include_metrics=True,
        )  # fmt: skip
        messages = list(client.stream(job))
        result = client.generate([30, 31], GREEDY, tenant="bob", include_metrics=True)
    assert plain.metrics is None  # not asked for
    assert isinstance(messages[-1], JobDone) and messages[-1].metrics is not None
    _check_metrics(result)
    tagged = _engine_request(requests_log, job)
    assert (tagged["priority"], tagged["tenant"], tagged["metadata"]) == (3, "alice", {"team": "x"})
    assert _engine_request(requests_log, result.job_id)["tenant"] == "bob"


async def test_async_client_sends_tenant_metadata_and_returns_metrics(endpoint, requests_log):
    async with AsyncJobClient(endpoint) as client:
        plain, asked = await asyncio.gather(
            client.generate("p", GREEDY, tenant="carol"),
            client.generate("q", GREEDY, metadata={"k": "v"}, include_metrics=True),
        )
        with pytest.raises(JobFailed) as refused:  # over OpenAI's 16 metadata pairs
            await client.generate("r", GREEDY, metadata={str(i): "v" for i in range(17)})
    assert plain.metrics is None
    _check_metrics(asked)
    assert refused.value.code == 400
    assert _engine_request(requests_log, plain.job_id)["tenant"] == "carol"
    assert _engine_request(requests_log, asked.job_id)["metadata"] == {"k": "v"}


def test_a_choice_cut_by_a_stop_string_still_gets_metrics(endpoint):
    # The frontend finishes the choice at the stop string and aborts it in the engine;
    # the engine's last delta (the abort's answer) carries the metrics.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with JobClient(endpoint) as client:
        full = client.generate("stop here", params)
        stop = full.text[10:14]
        cut = client.generate(
            "stop here", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
            include_metrics=True,
        )  # fmt: skip
    assert stop and cut.finish_reasons == ["stop"] and len(cut.text) < len(full.text)
    _check_metrics(cut)


def test_job_ids_never_repeat_across_clients_of_one_process():
    # the prefix was pid + id(self): a client built where a closed one had lived (CPython
    # reuses the address at once) repeated its job ids, and the engine's request ids
    from tokenloom.client_common import _JobIds

    seen = set()
    for _ in range(50):
        ids = _JobIds()
        seen.add(ids.next())
        del ids
    assert len(seen) == 50
