"""The one socket factory: every ZeroMQ socket of tokenloom is built here.

A socket is named by its channel; ``SOCKETS`` holds one row per channel (the
socket types of the side that binds and the side that connects, high-water mark,
linger, maximum message size). protocols/README.md documents the same table with
the message union that flows on each channel. Works with plain and
``zmq.asyncio`` contexts alike.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from dataclasses import dataclass

import zmq

MiB = 1 << 20


@dataclass(frozen=True)
class SocketSpec:
    """One channel. ``max_message_bytes`` is enforced by the channel's ``Decoder``
    (an oversized message gets an error reply); ZeroMQ itself drops frames over
    ``HARD_LIMIT_FACTOR`` times that, as a last guard against memory exhaustion."""

    binder_type: int
    connector_type: int
    hwm: int  # 0 = unbounded: back-pressure comes from the engine's bounded queue
    linger_ms: int  # how long close() may wait to flush unsent messages
    max_message_bytes: int


HARD_LIMIT_FACTOR = 4

SOCKETS: dict[str, SocketSpec] = {
    # frontend -> engine-core: EngineInput. The engine-core binds (PULL); every
    # frontend connects (PUSH).
    "engine-input": SocketSpec(zmq.PULL, zmq.PUSH, 0, 0, 64 * MiB),
    # engine-core -> frontend: EngineOutput. The engine-core binds (PUSH); the one
    # frontend process connects (PULL).
    # Linger so the last deltas (aborts at shutdown, error replies) get out.
    "engine-output": SocketSpec(zmq.PUSH, zmq.PULL, 0, 1000, 64 * MiB),
    # supervisor <-> engine-core: ControlMessage. The supervisor binds (PAIR); the
    # engine-core connects (PAIR). Linger so a last Ready/Failed/Shutdown gets out.
    "control": SocketSpec(zmq.PAIR, zmq.PAIR, 0, 1000, 1 * MiB),
    # job clients <-> zmq frontend: the public job protocol. The frontend binds
    # (ROUTER); each client connects (DEALER).
    "jobs": SocketSpec(zmq.ROUTER, zmq.DEALER, 0, 0, 64 * MiB),
    # engine-core (rank 0) -> tensor-parallel workers: StepMessage. Rank 0 binds
    # (PUB); each worker connects (SUB, subscribed to everything).
    "worker-steps": SocketSpec(zmq.PUB, zmq.SUB, 0, 0, 256 * MiB),
}


def make_socket(
    ctx: zmq.Context,
    name: str,
    endpoint: str,
    *,
    bind: bool,
    max_message_bytes: int | None = None,
) -> zmq.Socket:
    """Build, configure and bind (``bind=True``) or connect the socket of channel
    ``name`` on ``endpoint``. The socket's type follows from the channel and the side;
    ``max_message_bytes`` replaces the channel's limit (e.g. from the config).
    Raises KeyError for an unknown channel; zmq.ZMQError if the endpoint is unusable.
    """
    spec = SOCKETS[name]
    limit = spec.max_message_bytes if max_message_bytes is None else max_message_bytes
    sock = ctx.socket(spec.binder_type if bind else spec.connector_type)
    try:
        sock.setsockopt(zmq.LINGER, spec.linger_ms)
        sock.setsockopt(zmq.SNDHWM, spec.hwm)
        sock.setsockopt(zmq.RCVHWM, spec.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, limit * HARD_LIMIT_FACTOR)
        if sock.type == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def ipc_endpoint(tag: str) -> str:
    """A fresh ``ipc://`` endpoint in the temp dir, unique to this process and call:
    ``ipc:///tmp/tokenloom-<pid>-<tag>-<random>.sock``."""
    name = f"tokenloom-{os.getpid()}-{tag}-{secrets.token_hex(4)}.sock"
    return "ipc://" + os.path.join(tempfile.gettempdir(), name)


def remove_ipc_file(endpoint: str) -> None:
    """Delete the socket file behind an ``ipc://`` endpoint (no-op for others)."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint.removeprefix("ipc://"))


@dataclass(frozen=True)
class EngineEndpoints:
    """Where the engine-core's three sockets live."""

    input: str  # "engine-input"
    output: str  # "engine-output"
    control: str  # "control"

    @classmethod
    def new_ipc(cls) -> EngineEndpoints:
        return cls(ipc_endpoint("input"), ipc_endpoint("output"), ipc_endpoint("control"))

    def remove_files(self) -> None:
        for endpoint in (self.input, self.output, self.control):
            remove_ipc_file(endpoint)
