"""Per-request metrics through the served paths, real engine (tiny llama, CPU):
the OpenAI ``include_metrics`` extra, ``JobDone.metrics`` on ZeroMQ, ZeroMQ jobs in
/metrics like HTTP requests; and tenant / metadata reaching the engine request."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from conftest import server_config
from serving_fakes import InProcessEngine, ServerThread, asgi_frontend

from tokenloom.protocols.jobs import JobDone, JobOutput, JobReply, SubmitJob
from tokenloom.protocols.outputs import RequestMetrics, TokenDelta
from tokenloom.protocols.sampling import SamplingParams

pytestmark = pytest.mark.slow
DECODER = msgspec.msgpack.Decoder(JobReply)


@pytest.fixture(scope="module")
def real_server(served_model_dir: Any):
    server = ServerThread(server_config(served_model_dir), engine_factory=None).start()
    yield server
    assert server.stop() == 0


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _check(metrics: dict[str, Any]) -> None:
    assert abs(metrics["arrival_time"] - time.time()) < 120
    assert 0 <= metrics["queue_time"] <= metrics["time_to_first_token"]
    assert 0 < metrics["time_to_first_token"] <= metrics["e2e_time"] < 120
    assert metrics.get("num_preemptions", 0) == 0


def test_openai_response_carries_metrics_when_asked(real_server: Any) -> None:
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "n": 2}
    url = real_server.base_url + "/v1/completions"
    plain = httpx.post(url, json=body, timeout=60).json()
    assert "metrics" not in plain
    asked = httpx.post(url, json={**body, "include_metrics": True}, timeout=60).json()
    _check(asked["metrics"])
    chunks = []
    with httpx.stream("POST", url, json={**body, "include_metrics": True, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    _check(msgspec.json.decode(chunks[-1][6:])["metrics"])


def test_zmq_job_done_carries_metrics_and_jobs_count_in_prometheus(real_server: Any) -> None:
    ttft = "tokenloom_time_to_first_token_seconds_count"
    queue = "tokenloom_request_queue_time_seconds_count"
    before = _metric(real_server.base_url, ttft), _metric(real_server.base_url, queue)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(real_server.zmq_endpoint)
    try:
        params = SamplingParams(max_tokens=3, temperature=0)
        for i in range(3):
            submit = SubmitJob(f"j{i}", "hi", params=params, tenant="t", include_metrics=i > 0)
            sock.send(msgspec.msgpack.encode(submit))
        done: dict[str, JobDone] = {}
        while len(done) < 3:
            assert sock.poll(60_000), "no reply"
            reply = DECODER.decode(sock.recv())
            assert isinstance(reply, JobOutput | JobDone), reply
            if isinstance(reply, JobDone):
                done[reply.job_id] = reply
    finally:
        sock.close()
        ctx.term()
    assert done["j0"].metrics is None
    for job_id in ("j1", "j2"):
        metrics = done[job_id].metrics
        assert metrics is not None
        _check(msgspec.structs.asdict(metrics))
    after = _metric(real_server.base_url, ttft), _metric(real_server.base_url, queue)
    assert after[0] - before[0] == 3 and after[1] - before[1] == 3


class RecordingEngine(InProcessEngine):
    """Keeps each engine request and ends it with RequestMetrics, as the engine does."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Any] = []

    async def generate(self, request: Any) -> Any:
        self.requests.append(request)
        async for delta in super().generate(request):
            if delta.finish_reason is not None:
                arrival = request.arrival_time
                delta = TokenDelta(
                    delta.request_id, delta.new_token_ids, delta.finish_reason,
                    metrics=RequestMetrics(arrival, arrival + 0.5, arrival + 1.0, arrival + 3.0,
                                           2, 4),
                )  # fmt: skip
            yield delta


async def test_openai_user_and_metadata_reach_the_engine_request(served_model_dir: Any) -> None:
    engine = RecordingEngine()
    frontend = asgi_frontend(served_model_dir, engine)
    transport = httpx.ASGITransport(frontend.app.starlette)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        body = {"prompt": "hi", "max_tokens": 2, "user": "alice", "metadata": {"team": "x"}}
        response = await client.post("/v1/completions", json={**body, "include_metrics": True})
        too_many = {str(i): "v" for i in range(17)}
        refused = await client.post("/v1/completions", json={**body, "metadata": too_many})
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert (request.tenant, request.metadata) == ("alice", {"team": "x"})
    metrics = response.json()["metrics"]
    assert (metrics["queue_time"], metrics["time_to_first_token"], metrics["e2e_time"]) == (
        0.5, 1.0, 3.0,
    )  # fmt: skip
    assert (metrics["num_preemptions"], metrics["num_cached_tokens"]) == (2, 4)
    assert refused.status_code == 400 and "metadata" in refused.text
