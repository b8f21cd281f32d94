"""The engine client never drops an engine output silently (issue 15): an output it
cannot decode fails the requests it names, or every request in flight when it names
none; and request ids over the limit are refused before they reach the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from tokenloom.engine.client import AsyncEngineClient
from tokenloom.protocols.components.errors import EngineError
from tokenloom.protocols.outputs import EngineOutputs, TokenDelta
from tokenloom.protocols.requests import EngineInput, GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.serde import Decoder, Encoder
from tokenloom.transport.sockets import EngineEndpoints, make_socket

Sockets = tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]  # the engine side: (pull, push)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Sockets, AsyncEngineClient]]:
    ctx = zmq.asyncio.Context()
    ep = EngineEndpoints.new_ipc()
    pull = make_socket(ctx, "engine-input", ep.input, bind=True)
    push = make_socket(ctx, "engine-output", ep.output, bind=True)
    client = AsyncEngineClient(ep.input, ep.output, ctx=ctx, max_request_id_bytes=64)
    yield (pull, push), client
    await client.close()
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()
    ep.remove_files()


async def _start(client: AsyncEngineClient, pull: zmq.asyncio.Socket, rid: str) -> Any:
    stream = client.generate(GenerateRequest(rid, [1, 2], SamplingParams()))
    first = asyncio.ensure_future(anext(stream))
    decoded = Decoder(EngineInput, 1 << 20).decode(await asyncio.wait_for(pull.recv_multipart(), 5))
    assert decoded.request_id == rid
    return stream, first


async def test_an_undecodable_output_fails_the_requests_it_names_and_no_other(pair) -> None:
    (pull, push), client = pair
    _, first_a = await _start(client, pull, "a")
    _, first_b = await _start(client, pull, "b")
    # A delta whose token list is not a list: names "a", cannot be decoded.
    await push.send(msgspec.msgpack.encode(["outputs", [["a", "not-a-list"]], 0.0]))
    with pytest.raises(EngineError) as info:
        await asyncio.wait_for(first_a, 5)
    assert info.value.code == 500
    await push.send_multipart(Encoder().encode(EngineOutputs([TokenDelta("b", [7], "length")])))
    assert (await asyncio.wait_for(first_b, 5)).new_token_ids == [7]


async def test_an_unreadable_output_fails_every_request_in_flight(pair) -> None:
    (pull, push), client = pair
    _, first_a = await _start(client, pull, "a")
    _, first_b = await _start(client, pull, "b")
    await push.send(b"\xc1 not msgpack")
    for first in (first_a, first_b):
        with pytest.raises(EngineError):
            await asyncio.wait_for(first, 5)


async def test_a_request_id_over_the_limit_is_refused_before_it_is_sent(pair) -> None:
    (pull, _), client = pair
    with pytest.raises(EngineError) as info:
        await anext(client.generate(GenerateRequest("x" * 65, [1], SamplingParams())))
    assert info.value.code == 400
    assert not await pull.poll(100)
