"""The zmq frontend's wire behaviour, spoken raw over a DEALER socket: bad messages
get error replies (never a crash), jobs stream outputs and finish with JobDone."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from conftest import API_KEY

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


@pytest.fixture
def dealer(live_server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(live_server.zmq_endpoint)
    _send(sock, HelloJob(API_KEY))
    assert isinstance(_recv(sock), JobWelcome)
    yield sock
    sock.close()
    ctx.term()


def _send(sock: zmq.Socket, msg: object) -> None:
    sock.send(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))


def _recv(sock: zmq.Socket, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "no reply"
    return DECODER.decode(sock.recv())


def _until_done(sock: zmq.Socket) -> list:
    replies = []
    while True:
        reply = _recv(sock)
        replies.append(reply)
        if isinstance(reply, JobDone | JobError):
            return replies


@pytest.mark.parametrize(
    ("raw", "job_id"),
    [
        (b"\xc1 not msgpack", None),
        (msgspec.msgpack.encode(["launch", "j"]), "j"),
        (msgspec.msgpack.encode({"job_id": "j"}), None),
        (msgspec.msgpack.encode(["submit"]), None),
        (msgspec.msgpack.encode(["submit", "j1", 5]), "j1"),
        (msgspec.msgpack.encode(["submit", "j2", "hi", None, [1, -1.0]]), "j2"),
        (msgspec.msgpack.encode(SubmitJob("j3")), "j3"),
        (msgspec.msgpack.encode(SubmitJob("j4", "hi", [1, 2])), "j4"),
        (msgspec.msgpack.encode(SubmitJob("j5", prompt_token_ids=[])), "j5"),
        (msgspec.msgpack.encode(SubmitJob("j6", prompt_token_ids=[10**9])), "j6"),
        (
            msgspec.msgpack.encode(
                SubmitJob("j7", "x" * 2000, params=SamplingParams(max_tokens=250))
            ),
            "j7",
        ),
        (msgspec.msgpack.encode(AbortJob("never-submitted")), "never-submitted"),
    ],
)
def test_bad_message_gets_an_error_reply(dealer, raw, job_id):
    _send(dealer, raw)
    reply = _recv(dealer)
    assert isinstance(reply, JobError)
    assert reply.job_id == job_id
    assert 400 <= reply.code < 500
    assert reply.message


def test_ping_is_answered_with_engine_alive(dealer):
    _send(dealer, PingJob(42))
    assert _recv(dealer) == JobPong(42, True)


def test_job_streams_outputs_then_done_with_token_counts(dealer):
    _send(
        dealer, SubmitJob("ok", "hello there", params=SamplingParams(max_tokens=6, temperature=0))
    )
    replies = _until_done(dealer)
    outputs = [r for r in replies if isinstance(r, JobOutput)]
    done = replies[-1]
    assert isinstance(done, JobDone) and done.job_id == "ok"
    assert sum(len(o.token_ids) for o in outputs) == 6 == done.num_generated_tokens
    assert outputs[-1].finish_reason == "length"
    assert done.num_prompt_tokens > 0


def test_duplicate_job_id_is_refused_while_the_first_runs(dealer):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    _send(dealer, SubmitJob("dup", prompt_token_ids=[30, 31], params=params))
    _send(dealer, SubmitJob("dup", prompt_token_ids=[30, 31], params=params))
    replies = []
    while not any(isinstance(r, JobError) for r in replies):
        replies.append(_recv(dealer))
    assert [r.code for r in replies if isinstance(r, JobError)] == [409]
    _send(dealer, AbortJob("dup"))
    replies = _until_done(dealer)
    assert isinstance(replies[-1], JobDone)
    assert [r.finish_reason for r in replies if isinstance(r, JobOutput)][-1] == "abort"


def test_server_keeps_serving_after_garbage(dealer):
    for junk in (b"", b"\x00" * 100, b"\x92\xa6submit\xc0"):
        _send(dealer, junk)
        assert isinstance(_recv(dealer), JobError)
    _send(dealer, SubmitJob("after", prompt_token_ids=[40], params=SamplingParams(max_tokens=2)))
    assert isinstance(_until_done(dealer)[-1], JobDone)


def _ping_pong(sock: zmq.Socket, nonce: int = 7) -> None:
    _send(sock, PingJob(nonce))
    assert _recv(sock) == JobPong(nonce, True)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x91" * 1000
        + b"\xc0",  # arrays nested 1,000 deep: once a RecursionError that killed serve
        b"\x81\xa1k" * 5000 + b"\xc0",  # maps nested 5,000 deep
        b"\x93\xa6submit\xa1j" + b"\x91" * 100_000 + b"\xc0",  # deep inside a valid head
    ],
)
def test_deeply_nested_frame_gets_400_and_the_server_keeps_serving(dealer, raw):
    _send(dealer, raw)
    reply = _recv(dealer)
    assert isinstance(reply, JobError) and reply.code == 400
    _ping_pong(dealer)
    _send(
        dealer, SubmitJob("after-deep", prompt_token_ids=[40], params=SamplingParams(max_tokens=2))
    )
    assert isinstance(_until_done(dealer)[-1], JobDone)


def test_frame_over_the_limit_is_refused_with_413(dealer, live_server):
    limit = int(live_server.config.max_request_body_mb * (1 << 20))
    _send(dealer, msgspec.msgpack.encode(SubmitJob("big", "x" * (limit + 10))))
    reply = _recv(dealer, timeout_ms=20_000)
    assert isinstance(reply, JobError) and reply.code == 413 and reply.job_id is None
    _ping_pong(dealer)


@pytest.mark.parametrize(
    ("submit", "field"),
    [
        (SubmitJob("j" * 257, prompt_token_ids=[30]), "job_id"),
        (SubmitJob("n", prompt_token_ids=[30], params=SamplingParams(n=129)), "n"),
        (SubmitJob("stop", prompt_token_ids=[30], params=SamplingParams(stop=["a"] * 17)), "stop"),
        (
            SubmitJob("sti", prompt_token_ids=[30], params=SamplingParams(stop_token_ids=[1] * 17)),
            "stop_token_ids",
        ),
        (SubmitJob("long", prompt_token_ids=[30] * 300), "prompt_token_ids"),
        (SubmitJob("topk", prompt_token_ids=[30], params=SamplingParams(top_k=2**64 - 1)), "top_k"),
        (SubmitJob("prio", prompt_token_ids=[30], priority=2**64 - 1), "priority"),
        (
            SubmitJob(
                "sti64", prompt_token_ids=[30], params=SamplingParams(stop_token_ids=[2**64 - 1])
            ),
            "stop_token_ids",
        ),
    ],
)
def test_job_over_a_limit_is_refused_with_400_naming_the_field(dealer, submit, field):
    _send(dealer, submit)
    reply = _recv(dealer)
    assert isinstance(reply, JobError) and reply.code == 400
    assert field in reply.message
    if field == "job_id":
        assert reply.job_id is None  # a long id is not echoed back
    _ping_pong(dealer)


def test_abort_right_after_submit_ends_the_job_and_frees_its_id(dealer):
    params = SamplingParams(n=2, max_tokens=50, ignore_eos=True)
    for _ in range(3):  # the id is free again each time
        _send(dealer, SubmitJob("quick", prompt_token_ids=[30, 31], params=params))
        _send(dealer, AbortJob("quick"))
        replies = _until_done(dealer)
        assert isinstance(replies[-1], JobDone)
        reasons = sorted(
            (r.index, r.finish_reason)
            for r in replies
            if isinstance(r, JobOutput) and r.finish_reason
        )
        assert reasons == [(0, "abort"), (1, "abort")]
    _ping_pong(dealer)
    assert not dealer.poll(100), "nothing after the job's JobDone"
