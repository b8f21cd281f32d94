"""The socket factory, and tensors over a real ZeroMQ ipc:// socket."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from tokenloom.protocols.tensors import Tensor
from tokenloom.transport.serde import Decoder, Encoder
from tokenloom.transport.sockets import SOCKETS, EngineEndpoints, ipc_endpoint, make_socket


class KVBlock(msgspec.Struct, tag="kv", array_like=True, gc=False):
    block_id: int
    keys: Tensor  # [block_size, heads, head_dim]
    values: Tensor  # [block_size, heads, head_dim]


@pytest.mark.parametrize("name", sorted(SOCKETS))
def test_each_channel_builds_its_binder_and_connector_types(name: str) -> None:
    ctx = zmq.Context()
    endpoint = ipc_endpoint("test")
    server = make_socket(ctx, name, endpoint, bind=True)
    client = make_socket(ctx, name, endpoint, bind=False)
    try:
        assert server.type == SOCKETS[name].binder_type
        assert client.type == SOCKETS[name].connector_type
        assert server.getsockopt(zmq.LINGER) == SOCKETS[name].linger_ms
    finally:
        client.close()
        server.close()
        ctx.term()
        EngineEndpoints(endpoint, endpoint, endpoint).remove_files()


def test_unknown_channel_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        make_socket(zmq.Context.instance(), "no-such-channel", "inproc://x", bind=True)


def test_ipc_endpoints_are_unique_and_name_the_process() -> None:
    first, second = ipc_endpoint("input"), ipc_endpoint("input")
    assert first != second
    assert first.startswith("ipc://") and "tokenloom-" in first and "-input-" in first


def test_tensors_cross_an_ipc_socket_zero_copy_with_one_frame_each() -> None:
    ctx = zmq.Context()
    endpoint = ipc_endpoint("tensors")
    pull = make_socket(ctx, "engine-input", endpoint, bind=True)
    push = make_socket(ctx, "engine-input", endpoint, bind=False)
    keys = torch.randn(256, 8, 64)  # 512 KiB: above zmq's zero-copy threshold
    values = torch.randn(256, 8, 64)
    try:
        frames = Encoder().encode(KVBlock(7, keys, values))
        assert len(frames) == 3
        push.send_multipart(frames, copy=False)
        received = pull.recv_multipart(copy=False)
        assert len(received) == 3
        msg = Decoder(KVBlock, 16 << 20).decode(received)
        assert msg.block_id == 7
        assert torch.equal(msg.keys, keys) and torch.equal(msg.values, values)
        # The decoded tensor lives in the received frame's buffer, not in a copy.
        frame_address = np.frombuffer(received[1].buffer, dtype=np.uint8).ctypes.data
        assert msg.keys.data_ptr() == frame_address
    finally:
        push.close()
        pull.close()
        ctx.term()
        EngineEndpoints(endpoint, endpoint, endpoint).remove_files()


async def test_factory_builds_asyncio_sockets_from_an_asyncio_context() -> None:
    ctx = zmq.asyncio.Context()
    endpoint = ipc_endpoint("async")
    pull = make_socket(ctx, "engine-output", endpoint, bind=False)
    push = make_socket(ctx, "engine-output", endpoint, bind=True)
    try:
        assert isinstance(pull, zmq.asyncio.Socket)
        await push.send_multipart([b"hello"])
        assert await pull.recv_multipart() == [b"hello"]
    finally:
        push.close()
        pull.close()
        ctx.term()
        EngineEndpoints(endpoint, endpoint, endpoint).remove_files()
