"""Property: whatever a client does (submit, abort, read, disconnect, in any order),
every job of a connected client ends with exactly one terminal message, and no KV
block stays allocated once the clients are done. Raw DEALER sockets against the
real zmq frontend, supervisor and engine-core process around the fake engine (whose
KV blocks are accounted like a paged cache), and around the real engine (tiny random
llama on the CPU, whose KV manager must give every block back)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq
from conftest import server_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fakes import ServerThread

from tokenloom.protocols.jobs import (
    AbortJob,
    HelloJob,
    JobDone,
    JobError,
    JobOutput,
    JobReply,
    JobWelcome,
    SubmitJob,
)
from tokenloom.protocols.sampling import SamplingParams

DECODER = msgspec.msgpack.Decoder(JobReply)
NOT_TERMINAL = (404, 409)  # answers to an abort or a duplicate: the job itself goes on


@pytest.fixture(scope="module")
def server(served_model_dir):
    config = server_config(
        served_model_dir, frontends=["zmq"], plugin={"fake": {"step_s": 0.002}},
        num_blocks=256, max_num_seqs=8,
    )  # fmt: skip
    server = ServerThread(config).start()
    yield server
    assert server.stop() == 0


@dataclass
class Client:
    sock: zmq.Socket
    jobs: dict[str, int] = field(default_factory=dict)  # job id -> n
    replies: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    def read(self, timeout_ms: int = 0) -> bool:
        if not self.sock.poll(timeout_ms):
            return False
        msg = DECODER.decode(self.sock.recv())
        if isinstance(msg, JobOutput | JobDone | JobError):
            self.replies[msg.job_id].append(msg)
        return True

    def terminals(self, job_id: str) -> list:
        return [
            m
            for m in self.replies[job_id]
            if isinstance(m, JobDone) or (isinstance(m, JobError) and m.code not in NOT_TERMINAL)
        ]

    def all_ended(self) -> bool:
        return all(self.terminals(job_id) for job_id in self.jobs)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(0, 2),
            st.integers(1, 3),
            st.integers(1, 40),
            st.integers(1, 20),
        ),  # fmt: skip
        st.tuples(st.just("abort"), st.integers(0, 2), st.integers(0, 6)),
        st.tuples(st.just("read"), st.integers(0, 2), st.integers(1, 10)),
        st.tuples(st.just("disconnect"), st.integers(0, 2)),
        st.tuples(st.just("pause"), st.integers(1, 20)),
    ),
    min_size=1,
    max_size=25,
)


def _connect(ctx: zmq.Context, endpoint: str) -> Client:
    """A new connection that said hello (and was answered)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(msgspec.msgpack.encode(HelloJob()))
    assert sock.poll(5000), "hello not answered"
    assert isinstance(DECODER.decode(sock.recv()), JobWelcome)
    return Client(sock)


def _engine_stats(server: ServerThread):
    handle = server.handle
    return asyncio.run_coroutine_threadsafe(handle.engine.stats(), handle.loop).result(5)


@pytest.fixture(scope="module")
def real_server(served_model_dir):
    config = server_config(served_model_dir, frontends=["zmq"], num_blocks=128, max_num_seqs=8)
    server = ServerThread(config, engine_factory=None).start()
    yield server
    assert server.stop() == 0


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=ops)
def test_every_job_ends_once_and_no_kv_block_leaks(server, script):
    _run_script(server, script)


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=ops)
def test_real_engine_frees_every_kv_block_whatever_the_clients_do(real_server, script):
    _run_script(real_server, script)


def _run_script(server: ServerThread, script: list) -> None:
    ctx = zmq.Context()
    clients: dict[int, Client] = {}
    ended: list[Client] = []
    serial = 0
    try:
        for op in script:
            kind, *args = op
            if kind == "pause":
                time.sleep(args[0] / 1000)
                continue
            slot = args[0]
            if kind == "disconnect":
                if slot in clients:
                    clients.pop(slot).sock.close()
                continue
            client = clients.get(slot) or clients.setdefault(
                slot, _connect(ctx, server.zmq_endpoint)
            )
            if kind == "submit":
                _, n, max_tokens, first = args
                job_id = f"j{serial}"
                serial += 1
                params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
                client.sock.send(
                    msgspec.msgpack.encode(
                        SubmitJob(job_id, prompt_token_ids=[first + 20], params=params)
                    )
                )
                client.jobs[job_id] = n
            elif kind == "abort":
                ids = list(client.jobs)
                pick = args[1]
                job_id = ids[pick] if pick < len(ids) else f"unknown-{pick}"
                client.sock.send(msgspec.msgpack.encode(AbortJob(job_id)))
            else:
                for _ in range(args[1]):
                    if not client.read():
                        break
        deadline = time.monotonic() + 15
        for client in clients.values():
            while not client.all_ended():
                assert time.monotonic() < deadline, "a job never ended"
                client.read(100)
            while client.read(20):  # late 404s; and nothing may follow a terminal
                pass
            ended.append(client)
        for client in ended:
            for job_id, n in client.jobs.items():
                replies = client.replies[job_id]
                terminals = client.terminals(job_id)
                assert len(terminals) == 1, (job_id, replies)
                last = replies.index(terminals[0])
                assert all(isinstance(m, JobError) for m in replies[last + 1 :]), replies
                if isinstance(terminals[0], JobDone):
                    finished = [
                        m.index for m in replies if isinstance(m, JobOutput) and m.finish_reason
                    ]
                    assert sorted(finished) == list(range(n)), replies
    finally:
        # destroy closes every socket of the context, also one whose handshake failed
        # in _connect (ctx.term() would wait for it forever and hide the failure)
        ctx.destroy(linger=0)
    frontend = server.frontend("zmq")
    deadline = time.monotonic() + 10
    while True:
        stats = _engine_stats(server)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and len(frontend.live) == 0
        if idle and stats.num_blocks_free == stats.num_blocks_total:
            break
        assert time.monotonic() < deadline, f"leaked: {stats}, {len(frontend.live)} live"
        time.sleep(0.02)
