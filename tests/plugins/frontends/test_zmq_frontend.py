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
