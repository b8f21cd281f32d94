"""The kernel loop, in-process, with a fake engine over real ipc:// sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from loop_fakes import FakeEngine

from tokenloom.engine.loop import EngineLoop
from tokenloom.protocols.control import Shutdown
from tokenloom.protocols.outputs import EngineOutput, EngineOutputs, ErrorReply
from tokenloom.protocols.requests import (
    AbortRequest,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
)
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.serde import Decoder, Encoder
from tokenloom.transport.sockets import EngineEndpoints, make_socket

LIMIT = 4096  # the kernel's max message size in these tests


@dataclass
class Loop:
    kernel: EngineLoop
    engine: FakeEngine
    task: asyncio.Task[None]
    push: zmq.asyncio.Socket
    pull: zmq.asyncio.Socket
    control: zmq.asyncio.Socket
    encoder: Encoder
    decoder: Decoder[Any]

    async def send(self, msg: Any) -> None:
        await self.push.send_multipart(self.encoder.encode(msg))

    async def recv(self, timeout: float = 5.0) -> Any:
        frames = await asyncio.wait_for(self.pull.recv_multipart(), timeout)
        return self.decoder.decode(frames)

    async def deltas_until_finished(self, request_id: str) -> list[Any]:
        deltas = []
        while True:
            msg = await self.recv()
            assert isinstance(msg, EngineOutputs), msg
            mine = [d for d in msg.outputs if d.request_id == request_id]
            deltas.extend(mine)
            if mine and mine[-1].finish_reason is not None:
                return deltas


@pytest.fixture
async def loop() -> AsyncIterator[Loop]:
    ctx = zmq.asyncio.Context()
    ep = EngineEndpoints.new_ipc()
    control_server = make_socket(ctx, "control", ep.control, bind=True)
    engine_in = make_socket(ctx, "engine-input", ep.input, bind=True)
    engine_out = make_socket(ctx, "engine-output", ep.output, bind=True)
    engine_control = make_socket(ctx, "control", ep.control, bind=False)
    engine = FakeEngine()
    kernel = EngineLoop(
        engine,
        engine_in,
        engine_out,
        control_sock=engine_control,
        max_message_bytes=LIMIT,
    )
    task = asyncio.create_task(kernel.run())
    push = make_socket(ctx, "engine-input", ep.input, bind=False)
    pull = make_socket(ctx, "engine-output", ep.output, bind=False)
    yield Loop(
        kernel, engine, task, push, pull, control_server, Encoder(), Decoder(EngineOutput, 1 << 20)
    )
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for sock in (push, pull, control_server, engine_in, engine_out, engine_control):
        sock.close(linger=0)
    ctx.term()
    ep.remove_files()


def generate(rid: str, max_tokens: int = 3, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid, [1, 2, 3] if prompt is None else prompt, SamplingParams(max_tokens=max_tokens)
    )


async def test_generate_streams_deltas_until_the_finish_reason(loop: Loop) -> None:
    await loop.send(generate("a", max_tokens=3))
    deltas = await loop.deltas_until_finished("a")
    assert [d.new_token_ids for d in deltas] == [[0], [1], [2]]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


async def test_abort_ends_a_running_request_with_an_abort_delta(loop: Loop) -> None:
    await loop.send(generate("long", max_tokens=10_000))
    first = await loop.recv()
    assert first.outputs[0].request_id == "long"
    await loop.send(AbortRequest(["long", "unknown"]))
    deltas = await loop.deltas_until_finished("long")
    assert deltas[-1].finish_reason == "abort"
    assert not loop.engine.running


async def test_health_and_stats_replies_echo_the_nonce(loop: Loop) -> None:
    await loop.send(HealthRequest(nonce=7))
    health = await loop.recv()
    assert (health.nonce, health.ok) == (7, True)
    await loop.send(StatsRequest(nonce=8))
    stats = await loop.recv()
    assert stats.nonce == 8
    assert stats.stats.num_running == 0


async def test_malformed_message_gets_400_and_the_kernel_keeps_serving(loop: Loop) -> None:
    await loop.push.send_multipart([b"\xc1 not msgpack"])
    reply = await loop.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 400
    await loop.push.send_multipart([msgspec.msgpack.encode(["no-such-tag", 1])])
    reply = await loop.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 400
    await loop.send(HealthRequest(nonce=1))
    assert (await loop.recv()).ok


async def test_oversized_message_gets_413_and_the_kernel_keeps_serving(loop: Loop) -> None:
    await loop.send(generate("big", prompt=list(range(100, 100 + LIMIT))))
    reply = await loop.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 413
    await loop.send(generate("small", max_tokens=1))
    deltas = await loop.deltas_until_finished("small")
    assert deltas[-1].finish_reason == "length"


async def test_invalid_sampling_params_get_400(loop: Loop) -> None:
    body = msgspec.msgpack.encode(["generate", "bad", [1], [1, -1.0]])  # temperature < 0
    await loop.push.send_multipart([body])
    reply = await loop.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 400
    assert "temperature" in reply.message


async def test_refused_requests_get_error_replies_with_their_request_id(loop: Loop) -> None:
    await loop.send(generate("empty", prompt=[]))
    reply = await loop.recv()
    assert (reply.code, reply.request_id) == (400, "empty")
    loop.engine.max_running = 1
    await loop.send(generate("first", max_tokens=10_000))
    await loop.send(generate("second"))
    while not isinstance(reply := await loop.recv(), ErrorReply):
        pass
    assert (reply.code, reply.request_id) == (503, "second")


async def test_shutdown_lets_short_requests_finish_and_aborts_the_rest(loop: Loop) -> None:
    await loop.send(generate("short", max_tokens=3))
    await loop.send(generate("endless", max_tokens=100_000))
    await loop.recv()
    await loop.control.send_multipart(loop.encoder.encode(Shutdown(grace_s=0.3)))
    finish: dict[str, str] = {}
    while len(finish) < 2:
        msg = await loop.recv()
        for d in msg.outputs:
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason
    assert finish == {"short": "length", "endless": "abort"}
    await asyncio.wait_for(loop.task, 2.0)
    assert loop.task.exception() is None


async def test_generate_during_shutdown_gets_503(loop: Loop) -> None:
    loop.engine.step_s = 0.02
    await loop.send(generate("running", max_tokens=100_000))
    await loop.recv()
    loop.kernel.request_stop(grace_s=5.0)
    await loop.send(generate("late"))
    while not isinstance(reply := await loop.recv(), ErrorReply):
        pass
    assert (reply.code, reply.request_id) == (503, "late")


async def test_idle_kernel_does_not_spin(loop: Loop) -> None:
    await asyncio.sleep(0.3)
    assert loop.engine.num_steps == 0
    assert not loop.task.done()


async def test_a_huge_request_id_is_refused_alone_and_other_requests_stream_on(
    loop: Loop,
) -> None:
    huge = "j" * 2000  # over the engine's request id limit, under the message limit
    await loop.send(generate(huge, max_tokens=3))
    await loop.send(generate("other", max_tokens=3))
    reply = await loop.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 400 and reply.request_id == huge
    deltas = await loop.deltas_until_finished("other")
    assert [d.new_token_ids for d in deltas] == [[0], [1], [2]]
    assert huge not in loop.engine.limits


async def test_a_step_over_the_output_limit_is_split_and_nothing_is_lost(loop: Loop) -> None:
    loop.kernel.max_output_bytes = 200
    ids = [f"{i}-" + "r" * 60 for i in range(4)]  # four ~70-byte deltas per step
    for rid in ids:
        await loop.send(generate(rid, max_tokens=3))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    while finished != set(ids):
        frames = await asyncio.wait_for(loop.pull.recv_multipart(), 5)
        assert sum(len(f) for f in frames) <= 200
        for delta in loop.decoder.decode(frames).outputs:
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                finished.add(delta.request_id)
    assert all(t == [0, 1, 2] for t in tokens.values())
