"""The zmq frontend's sessions, spoken raw over DEALER sockets: the API key gates
jobs, a job's outputs go only to the connection that submitted it, and a client that
goes silent loses its jobs after the heartbeat timeout."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from conftest import API_KEY, server_config
from serving_fakes import ServerThread

from tokenloom.client import AsyncJobClient, JobClient, JobFailed
from tokenloom.plugins.frontends.zmq.sessions import TOMBSTONE_S
from tokenloom.protocols.jobs import (
    AbortJob,
    HelloJob,
    JobDone,
    JobError,
    JobOutput,
    JobPong,
    JobReply,
    JobWelcome,
    PingJob,
    SubmitJob,
)
from tokenloom.protocols.sampling import SamplingParams

DECODER = msgspec.msgpack.Decoder(JobReply)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open (term() would hang)


def _dealer(ctx: zmq.Context, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def _send(sock: zmq.Socket, msg: object) -> None:
    sock.send(msgspec.msgpack.encode(msg))


def _recv(sock: zmq.Socket, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "no reply"
    return DECODER.decode(sock.recv())


def _hello(sock: zmq.Socket, key: str | None = API_KEY) -> None:
    _send(sock, HelloJob(key))
    assert isinstance(_recv(sock), JobWelcome)


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_jobs_need_hello_with_the_api_key_but_ping_is_open(live_server, ctx):
    sock = _dealer(ctx, live_server.zmq_endpoint)
    _send(sock, SubmitJob("j", prompt_token_ids=[30]))
    assert (reply := _recv(sock)) == JobError("j", 401, reply.message)
    _send(sock, AbortJob("j"))
    assert _recv(sock).code == 401
    _send(sock, PingJob(3))
    assert _recv(sock) == JobPong(3, True)
    for wrong in (None, "", "test-kez", API_KEY + "x"):
        _send(sock, HelloJob(wrong))
        assert (reply := _recv(sock)) == JobError(None, 401, reply.message)
        _send(sock, SubmitJob("j", prompt_token_ids=[30]))
        assert _recv(sock).code == 401
    _hello(sock)
    _send(sock, SubmitJob("j", prompt_token_ids=[30], params=SamplingParams(max_tokens=2)))
    while not isinstance(reply := _recv(sock), JobDone | JobError):
        pass
    assert isinstance(reply, JobDone)
    sock.close()


def test_python_clients_send_the_api_key(live_server):
    with JobClient(live_server.zmq_endpoint, api_key=API_KEY) as client:
        assert client.generate([30], SamplingParams(max_tokens=3)).num_generated_tokens == 3
    with (
        JobClient(live_server.zmq_endpoint, api_key="wrong") as client,
        pytest.raises(JobFailed) as info,
    ):
        client.submit([30])
    assert info.value.code == 401


def test_a_second_connection_with_a_live_routing_id_gets_nothing_and_aborts_nothing(
    live_server, ctx
):
    victim = _dealer(ctx, live_server.zmq_endpoint, b"alice")
    _hello(victim)
    _send(victim, SubmitJob("secret", prompt_token_ids=[30], params=SamplingParams(max_tokens=60)))
    assert isinstance(_recv(victim), JobOutput)
    thief = _dealer(ctx, live_server.zmq_endpoint, b"alice")
    thief.send(msgspec.msgpack.encode(HelloJob(API_KEY)))
    thief.send(msgspec.msgpack.encode(AbortJob("secret")))
    replies = []
    while not isinstance(reply := _recv(victim), JobDone | JobError):
        replies.append(reply)
    assert isinstance(reply, JobDone) and reply.num_generated_tokens == 60
    assert all(r.finish_reason in (None, "length") for r in replies)
    assert not thief.poll(200), "the thief received something"
    victim.close()
    thief.close()


def test_outputs_never_reach_a_newcomer_that_reuses_a_gone_routing_id(live_server, ctx):
    frontend = live_server.frontend("zmq")
    victim = _dealer(ctx, live_server.zmq_endpoint, b"bob")
    _hello(victim)
    _send(victim, SubmitJob("secret", prompt_token_ids=[30], params=LONG))
    assert isinstance(_recv(victim), JobOutput)
    victim.close()
    # libzmq itself refuses a routing id while the old connection's pipe is still being
    # torn down, and that newcomer then hears nothing, ever (seen with bare pyzmq): a
    # client that reuses an id must wait for the server to let go of it. Then a client
    # id back on the same descriptor counts as the gone one's last words for a moment.
    _wait_until(lambda: b"bob" not in frontend.connections.sessions)
    time.sleep(TOMBSTONE_S + 0.1)
    thief = _dealer(ctx, live_server.zmq_endpoint, b"bob")
    assert not thief.poll(500), "the newcomer received the gone client's outputs"
    _send(thief, AbortJob("secret"))
    assert _recv(thief).code == 401  # a new connection: no session, no jobs
    _hello(thief)
    _send(thief, AbortJob("secret"))
    assert (reply := _recv(thief)) == JobError("secret", 404, reply.message)
    _wait_until(lambda: len(frontend.live) == 0)  # the gone client's job was aborted
    thief.close()


def test_connection_churn_loses_no_message_and_leaks_no_session(live_server, ctx):
    """Clients connect, say hello, submit and drop in quick succession, so descriptors
    are reused at once and monitor events trail the messages. Before the fix (issue 15)
    about one hello in forty was never answered (a synchronous send on a shadow of the
    asyncio socket consumed the receive loop's wake-up), and messages read after their
    connection's DISCONNECTED opened sessions, and ran jobs, for nobody."""
    import random

    frontend = live_server.frontend("zmq")
    rng = random.Random(15)
    unanswered = 0
    for round_ in range(120):
        socks = []
        for k in range(rng.randint(1, 4)):
            sock = _dealer(ctx, live_server.zmq_endpoint)
            _send(sock, HelloJob(API_KEY))
            if sock.poll(3000):
                assert isinstance(DECODER.decode(sock.recv()), JobWelcome)
            else:
                unanswered += 1
            if rng.random() < 0.5:
                params = SamplingParams(max_tokens=rng.choice([3, 200]), ignore_eos=True)
                _send(sock, SubmitJob(f"j{round_}-{k}", prompt_token_ids=[30], params=params))
            socks.append(sock)
            if rng.random() < 0.5:
                socks.pop(rng.randrange(len(socks))).close()
        time.sleep(rng.random() * 0.01)
        for sock in socks:
            sock.close()
    assert unanswered == 0
    _wait_until(lambda: not frontend.connections.sessions, timeout_s=10)
    _wait_until(lambda: len(frontend.live) == 0, timeout_s=10)  # every job was aborted


@pytest.fixture(scope="module")
def heartbeat_server(served_model_dir):
    config = server_config(
        served_model_dir, frontends=["zmq"], zmq_heartbeat_timeout_s=0.6,
        plugin={"fake": {"step_s": 0.02}},
    )  # fmt: skip
    server = ServerThread(config).start()
    yield server
    assert server.stop() == 0


def test_a_silent_client_loses_its_jobs_with_408(heartbeat_server, ctx):
    sock = _dealer(ctx, heartbeat_server.zmq_endpoint)
    _send(sock, SubmitJob("quiet", prompt_token_ids=[30], params=LONG))  # 200 steps: 4 s
    started = time.monotonic()
    while not isinstance(reply := _recv(sock), JobDone | JobError):
        assert reply.finish_reason is None
    assert reply == JobError("quiet", 408, reply.message)
    assert 0.6 <= time.monotonic() - started < 2.5
    _wait_until(lambda: len(heartbeat_server.frontend("zmq").live) == 0)
    sock.close()


def test_a_client_that_pings_keeps_its_jobs(heartbeat_server, ctx):
    sock = _dealer(ctx, heartbeat_server.zmq_endpoint)
    _send(sock, SubmitJob("chatty", prompt_token_ids=[30], params=SamplingParams(max_tokens=80)))
    last_ping = time.monotonic()
    while True:  # 80 steps: 1.6 s, more than twice the timeout
        if time.monotonic() - last_ping > 0.2:
            _send(sock, PingJob(0))
            last_ping = time.monotonic()
        reply = _recv(sock)
        if isinstance(reply, JobDone | JobError):
            break
    assert isinstance(reply, JobDone) and reply.num_generated_tokens == 80
    sock.close()


def test_python_clients_ping_in_the_background(heartbeat_server):
    with JobClient(heartbeat_server.zmq_endpoint) as client:
        job = client.submit([30], SamplingParams(max_tokens=80))
        time.sleep(0.1)
        result = list(client.stream(job))
    assert isinstance(result[-1], JobDone) and result[-1].num_generated_tokens == 80


async def test_async_client_sends_the_api_key(live_server):
    async with AsyncJobClient(live_server.zmq_endpoint, api_key=API_KEY) as client:
        result = await client.generate([30], SamplingParams(max_tokens=3))
        assert result.num_generated_tokens == 3
    async with AsyncJobClient(live_server.zmq_endpoint, api_key="wrong") as client:
        with pytest.raises(JobFailed) as info:
            await client.submit([30])
    assert info.value.code == 401


async def test_async_client_keeps_jobs_alive_while_the_caller_does_other_work(heartbeat_server):
    async with AsyncJobClient(heartbeat_server.zmq_endpoint) as client:
        job = await client.submit([30], SamplingParams(max_tokens=60))
        await asyncio.sleep(1.5)  # 2.5 heartbeat timeouts without reading: the pinger speaks
        messages = [m async for m in client.stream(job)]
    assert isinstance(messages[-1], JobDone) and messages[-1].num_generated_tokens == 60


@pytest.fixture(scope="module")
def small_queue_server(served_model_dir):
    """HTTP and ZeroMQ over one engine with room for 4 sequences (1 running + 3 waiting)."""
    config = server_config(
        served_model_dir, max_num_seqs=1, max_waiting_requests=3,
        plugin={"fake": {"step_s": 0.02}},
    )  # fmt: skip
    server = ServerThread(config).start()
    yield server
    assert server.stop() == 0


def test_http_and_zmq_share_one_admission_count_and_one_metrics(small_queue_server, ctx):
    import httpx

    busy = _dealer(ctx, small_queue_server.zmq_endpoint)
    _send(busy, SubmitJob("fill", prompt_token_ids=[30], params=SamplingParams(n=3, **_LONG)))
    _wait_until(lambda: small_queue_server.frontend("zmq").live.admission.in_flight == 3)
    # HTTP sees the ZeroMQ job's sequences: refused at once, before any engine work.
    with httpx.Client(base_url=small_queue_server.base_url) as http:
        started = time.monotonic()
        body = {"prompt": [30], "max_tokens": 2, "n": 2}  # 3 + 2 sequences > 4
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert time.monotonic() - started < 0.5
        # ... and so does a second ZeroMQ job.
        late = _dealer(ctx, small_queue_server.zmq_endpoint)
        _send(late, SubmitJob("late", prompt_token_ids=[30], params=SamplingParams(n=2)))
        reply = _recv(late)
        assert isinstance(reply, JobError) and reply.code == 503
        _send(busy, AbortJob("fill"))
        while not isinstance(_recv(busy), JobDone):
            pass
        _wait_until(lambda: small_queue_server.frontend("zmq").live.admission.in_flight == 0)
        _send(late, SubmitJob("ok", prompt_token_ids=[30], params=SamplingParams(max_tokens=2)))
        while not isinstance(reply := _recv(late), JobDone | JobError):
            pass
        assert isinstance(reply, JobDone)
        # Finished ZeroMQ jobs are counted in /metrics with the HTTP requests.
        metrics = http.get("/metrics").text
    counted = [
        line for line in metrics.splitlines()
        if line.startswith("tokenloom_request_success_total") and not line.startswith("#")
    ]  # fmt: skip
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) >= 2  # "fill" and "ok"
    busy.close()
    late.close()


_LONG = {"max_tokens": 200, "ignore_eos": True}
