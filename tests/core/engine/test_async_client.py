"""AsyncEngineClient against a scripted engine side (raw sockets, no kernel)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tokenloom.engine.client import AsyncEngineClient
from tokenloom.protocols.components.errors import EngineDeadError, EngineError
from tokenloom.protocols.outputs import (
    EngineOutputs,
    EngineStats,
    ErrorReply,
    HealthReply,
    StatsReply,
    TokenDelta,
)
from tokenloom.protocols.requests import AbortRequest, EngineInput, GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.serde import Decoder, Encoder
from tokenloom.transport.sockets import EngineEndpoints, make_socket


@dataclass
class ScriptedEngine:
    pull: zmq.asyncio.Socket
    push: zmq.asyncio.Socket
    decoder: Decoder[Any]
    encoder: Encoder

    async def recv(self) -> Any:
        return self.decoder.decode(await asyncio.wait_for(self.pull.recv_multipart(), 5))

    async def send(self, msg: Any) -> None:
        await self.push.send_multipart(self.encoder.encode(msg))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ScriptedEngine, AsyncEngineClient]]:
    ctx = zmq.asyncio.Context()
    ep = EngineEndpoints.new_ipc()
    engine = ScriptedEngine(
        make_socket(ctx, "engine-input", ep.input, bind=True),
        make_socket(ctx, "engine-output", ep.output, bind=True),
        Decoder(EngineInput, 1 << 20),
        Encoder(),
    )
    client = AsyncEngineClient(
        ep.input, ep.output, ctx=ctx, reply_timeout_s=1.0, max_request_bytes=1000
    )
    yield engine, client
    await client.close()
    engine.pull.close(linger=0)
    engine.push.close(linger=0)
    ctx.term()
    ep.remove_files()


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2], SamplingParams())


async def test_deltas_are_routed_to_their_own_request(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair
    a, b = client.generate(request("a")), client.generate(request("b"))
    first_a, first_b = asyncio.ensure_future(anext(a)), asyncio.ensure_future(anext(b))
    assert {(await engine.recv()).request_id, (await engine.recv()).request_id} == {"a", "b"}
    await engine.send(EngineOutputs([TokenDelta("b", [20]), TokenDelta("a", [10])]))
    assert (await first_a).new_token_ids == [10]
    assert (await first_b).new_token_ids == [20]
    await engine.send(
        EngineOutputs([TokenDelta("a", [11], "stop"), TokenDelta("b", [21], "length")])
    )
    assert [d.new_token_ids async for d in a] == [[11]]
    assert [d.finish_reason async for d in b] == ["length"]


async def test_error_reply_for_a_request_raises_from_its_iterator(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair
    stream = client.generate(request("r"))
    pending = asyncio.ensure_future(anext(stream))
    await engine.recv()
    await engine.send(ErrorReply(503, "queue full", "r"))
    with pytest.raises(EngineError) as err:
        await pending
    assert err.value.code == 503


async def test_leaving_the_iterator_early_sends_an_abort(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair
    stream = client.generate(request("r"))
    pending = asyncio.ensure_future(anext(stream))
    await engine.recv()
    await engine.send(EngineOutputs([TokenDelta("r", [1])]))
    await pending
    await stream.aclose()
    assert await engine.recv() == AbortRequest(["r"])


async def test_stats_and_health_match_replies_by_nonce(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair
    stats = asyncio.ensure_future(client.stats())
    asked = await engine.recv()
    await engine.send(StatsReply(asked.nonce + 100, EngineStats(num_running=9)))  # not ours
    await engine.send(StatsReply(asked.nonce, EngineStats(num_running=2)))
    assert (await stats).num_running == 2
    health = asyncio.ensure_future(client.health())
    asked = await engine.recv()
    await engine.send(HealthReply(asked.nonce, ok=True))
    assert await health is True


async def test_health_is_false_when_the_engine_does_not_answer(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    _, client = pair
    assert await client.health() is False


async def test_a_request_over_the_size_limit_is_refused_before_sending(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair  # the client was built with max_request_bytes=1000
    huge = GenerateRequest("huge", [7] * 1000, SamplingParams())
    with pytest.raises(EngineError) as err:
        await anext(client.generate(huge))
    assert err.value.code == 413
    assert not await engine.pull.poll(100)  # nothing was sent


async def test_mark_dead_from_another_thread_fails_pending_and_later_calls(
    pair: tuple[ScriptedEngine, AsyncEngineClient],
) -> None:
    engine, client = pair
    stream = client.generate(request("r"))
    pending = asyncio.ensure_future(anext(stream))
    await engine.recv()
    await asyncio.to_thread(client.mark_dead, "engine-core exited with code -9")
    with pytest.raises(EngineDeadError, match="code -9"):
        await pending
    assert not client.is_alive
    with pytest.raises(EngineDeadError):
        await anext(client.generate(request("later")))
