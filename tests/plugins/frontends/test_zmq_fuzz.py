"""Fuzz of the zmq frontend's decoder (bounded budget): random bytes, deeply nested
msgpack and bit-flipped valid frames each get exactly one reply (an error, or the pong
a mutated ping asks for), and the server stays alive and serves a job afterwards."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import zmq
from conftest import API_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
NONCES = itertools.count(1_000_000)
FUZZ = settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

VALID_FRAMES = [
    msgspec.msgpack.encode(m)
    for m in (
        SubmitJob("job-1", "hello", params=SamplingParams(max_tokens=4, stop=["\n"], seed=3)),
        SubmitJob("job-2", prompt_token_ids=[30, 31], params=SamplingParams(n=2, top_k=5)),
        SubmitJob("job-3", prompt_token_ids=[30], priority=-7),
        AbortJob("job-1"),
        PingJob(12345),
        HelloJob("not-the-key"),
    )
]


@pytest.fixture(scope="module")
def sockets(live_server):
    ctx = zmq.Context()
    authed, anonymous = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (authed, anonymous):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(live_server.zmq_endpoint)
    authed.send(msgspec.msgpack.encode(HelloJob(API_KEY)))
    assert authed.poll(5000) and isinstance(DECODER.decode(authed.recv()), JobWelcome)
    yield authed, anonymous
    authed.close()
    anonymous.close()
    ctx.term()


def _replies_to(sock: zmq.Socket, frame: bytes) -> list:
    """Send ``frame``, then a ping; the replies that came before its pong."""
    nonce = next(NONCES)
    sock.send(frame)
    sock.send(msgspec.msgpack.encode(PingJob(nonce)))
    replies = []
    while True:
        assert sock.poll(5000), "the server stopped answering"
        reply = DECODER.decode(sock.recv())
        if reply == JobPong(nonce, True):
            return replies
        replies.append(reply)


def _assert_one_error_or_pong(replies: list) -> None:
    assert len(replies) == 1, replies
    assert isinstance(replies[0], JobError | JobPong), replies


@st.composite
def nested(draw) -> bytes:
    opener = draw(
        st.sampled_from(
            [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\x92\xc0", b"\x93\xa6submit\xa1j\x91"]
        )
    )
    return opener * draw(st.integers(10, 20_000)) + draw(st.binary(max_size=4))


@st.composite
def mutated(draw) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for bit in draw(st.lists(st.integers(0, 8 * len(frame) - 1), min_size=1, max_size=4)):
        frame[bit // 8] ^= 1 << (bit % 8)
    cut = draw(st.integers(0, len(frame)))
    return bytes(frame[:cut] if draw(st.booleans()) else frame) + draw(st.binary(max_size=3))


@FUZZ
@given(frame=st.binary(max_size=600))
def test_random_bytes_get_one_reply(sockets, frame):
    _assert_one_error_or_pong(_replies_to(sockets[0], frame))


@FUZZ
@given(frame=nested())
def test_deeply_nested_frames_get_400(sockets, frame):
    replies = _replies_to(sockets[0], frame)
    assert len(replies) == 1 and isinstance(replies[0], JobError), replies
    assert replies[0].code == 400


@FUZZ
@given(frame=mutated())
def test_bit_flipped_frames_get_one_reply(sockets, frame):
    # Unauthenticated: a mutated submit that still decodes is refused (401), not run.
    _assert_one_error_or_pong(_replies_to(sockets[1], frame))


def test_server_serves_after_the_fuzz(sockets):
    authed, _ = sockets
    assert _replies_to(authed, msgspec.msgpack.encode(PingJob(1))) == [JobPong(1, True)]
    job = SubmitJob("after-fuzz", prompt_token_ids=[30], params=SamplingParams(max_tokens=3))
    authed.send(msgspec.msgpack.encode(job))
    replies = []
    while not isinstance(replies[-1:] and replies[-1], JobDone | JobError):
        assert authed.poll(5000)
        replies.append(DECODER.decode(authed.recv()))
    assert isinstance(replies[-1], JobDone)
    assert sum(len(r.token_ids) for r in replies if isinstance(r, JobOutput)) == 3
