"""Open endpoints hammered in a loop cost the server a bounded share of the CPU (issue
15: on the 2-core CPU an unpaced loop on /health, /v1/models, /metrics or /version
slowed generation 6-30x): fast-lane answers are paced per connection, and /metrics
too, which bounds the engine stats round trips a scraping loop costs."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from serving_fakes import InProcessEngine, asgi_frontend
from test_health_under_load import Served

from tokenloom.plugins.frontends.openai.fast_lane import FAST_RATE, SLOW_RATE, Pacer


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def _hammer(port: int, path: str, seconds: float) -> int:
    """GET ``path`` back to back on one keep-alive connection; how many were answered."""
    request = f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()
    answered = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"}"):
                chunk = sock.recv(4096)
                assert chunk
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ")
            answered += 1
    return answered


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/version"])
def test_a_client_hammering_an_open_endpoint_is_paced(model_dir, path):
    with Served(model_dir, step_s=0.0) as served:
        answered = _hammer(served.frontend.port, path, 1.5)
        # another connection is not held back by the hammering one
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", served.frontend.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        fresh = time.perf_counter() - started
    # unpaced, a loop on loopback got 3,700-5,400 answers a second here
    assert answered <= FAST_RATE * 1.5 + FAST_RATE + 50, answered
    assert answered >= 100  # paced, not refused
    assert fresh < 1.0


def test_pacer_holds_a_connection_over_its_rate_and_no_other():
    pacer = Pacer(rate=10.0, burst=5.0)
    assert [pacer.delay("a") for _ in range(5)] == [0.0] * 5
    held = pacer.delay("a")
    assert 0.05 < held <= 0.11  # one token at 10/s, less what accrued meanwhile
    assert pacer.delay("b") == 0.0


async def test_a_metrics_scraping_loop_is_paced_and_so_are_its_engine_round_trips(model_dir):
    engine = InProcessEngine()
    calls = 0
    stats = engine.stats

    async def counting_stats():
        nonlocal calls
        calls += 1
        return await stats()

    engine.stats = counting_stats
    frontend = asgi_frontend(model_dir, engine)
    transport = httpx.ASGITransport(app=frontend.app.starlette, client=("10.0.0.1", 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        started = time.perf_counter()
        answered = 0
        while time.perf_counter() - started < 1.5:
            assert (await http.get("/metrics")).status_code == 200
            answered += 1
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - started
    assert answered <= SLOW_RATE * elapsed + 2 * SLOW_RATE + 1, answered
    assert calls <= answered  # one engine round trip per scrape at most
