"""The engine-core as a real process: supervisor, async client, fake engine, ipc://."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from loop_fakes import make_fake_engine

from tokenloom.config import EngineConfig
from tokenloom.engine.client import AsyncEngineClient
from tokenloom.engine.supervisor import EngineStartError, Supervisor
from tokenloom.protocols.components.errors import EngineDeadError, EngineError
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.sockets import remove_ipc_file


def request(rid: str, max_tokens: int = 3, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid, [1, 2] if prompt is None else prompt, SamplingParams(max_tokens=max_tokens)
    )


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Supervisor, AsyncEngineClient]]:
    sup = Supervisor(
        EngineConfig(model="slow", engine_start_timeout_s=30, shutdown_grace_s=1.0),
        engine_factory=make_fake_engine,
    )
    ready = await sup.start_async()
    assert ready.pid == sup.pid
    client = AsyncEngineClient(sup.endpoints.input, sup.endpoints.output)
    sup.watch(lambda code: client.mark_dead(f"engine-core exited with code {code}"))
    yield sup, client
    await client.close()
    await sup.stop_async()


async def test_loopback_generate_abort_health_and_stats(
    engine: tuple[Supervisor, AsyncEngineClient],
) -> None:
    _, client = engine
    assert await client.health()
    tokens = [d.new_token_ids[0] async for d in client.generate(request("a", max_tokens=3))]
    assert tokens == [0, 1, 2]
    with pytest.raises(EngineError) as refused:
        async for _ in client.generate(request("empty", prompt=[])):
            pass
    assert refused.value.code == 400

    stream = client.generate(request("long", max_tokens=100_000))
    await anext(stream)
    stats = await client.stats()
    assert stats.num_running == 1
    await stream.aclose()  # leaving early aborts the request in the engine
    for _ in range(50):
        if (await client.stats()).num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert (await client.stats()).num_running == 0


async def test_clean_stop_exits_zero(engine: tuple[Supervisor, AsyncEngineClient]) -> None:
    sup, _ = engine
    assert await sup.stop_async() == 0
    assert not sup.is_alive


async def test_killed_engine_is_detected_within_five_seconds(
    engine: tuple[Supervisor, AsyncEngineClient],
) -> None:
    sup, client = engine
    stream = client.generate(request("pending", max_tokens=100_000))
    await anext(stream)
    killed_at = time.monotonic()
    assert sup.pid is not None
    os.kill(sup.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    assert time.monotonic() - killed_at < 5.0
    assert not client.is_alive
    with pytest.raises(EngineDeadError):
        await client.stats()


def test_start_failure_raises_with_the_engine_traceback() -> None:
    sup = Supervisor(
        EngineConfig(model="fail", engine_start_timeout_s=30), engine_factory=make_fake_engine
    )
    with pytest.raises(EngineStartError) as failed:
        sup.start()
    assert "fake engine refused to start: boom" in str(failed.value)
    assert "Traceback" in str(failed.value)
    assert not sup.is_alive


ORPHAN_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from loop_fakes import make_fake_engine
from tokenloom.config import EngineConfig
from tokenloom.engine.supervisor import Supervisor
sup = Supervisor(EngineConfig(engine_start_timeout_s=30), engine_factory=make_fake_engine)
sup.start()
print(sup.pid, sup.endpoints.control, flush=True)
os._exit(0)  # die without stopping the engine-core
"""


def test_engine_core_exits_when_its_parent_dies() -> None:
    script = ORPHAN_SCRIPT.format(tests=str(Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    pid_text, control_endpoint = out.stdout.split()
    pid = int(pid_text)
    remove_ipc_file(control_endpoint)  # the dead parent's bound socket
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.1)
    assert not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited child reparented to an init that has not reaped it yet is a zombie.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"
