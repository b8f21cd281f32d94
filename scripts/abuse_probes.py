"""The probes of ``scripts/abuse.py`` (issue 15), one coroutine each: a probe takes
the HTTP client (and what else it needs) and returns one row of the report, a dict
with ``probe``, ``ok`` (True, False, or None when skipped) and its figures."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio
from abuse_http import keep_alive_burst, read_response

from tokenloom.protocols.jobs import HelloJob, PingJob, SubmitJob
from tokenloom.protocols.sampling import SamplingParams

Row = dict[str, Any]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    median = 1e3 * statistics.median(values)
    return f"p50 {median:.0f} ms, p99 {1e3 * _p99(values):.0f} ms"


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _engine_pid(server_pid: int) -> int | None:
    """The engine-core: the server's child running ``tokenloom.engine.process``."""
    for task in Path(f"/proc/{server_pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"tokenloom.engine.process" in cmdline:
                return int(child)
    return None


async def _metrics(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line.startswith("tokenloom_") and " " in line and "{" not in line:
            name, _, value = line.partition(" ")
            values[name.removeprefix("tokenloom_")] = float(value)
    return values


def _http_cases(rng: random.Random, n: int, body_mb: float) -> list[tuple[str, dict, bytes]]:
    deep = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    fixed: list[tuple[str, dict, bytes]] = [
        ("/v1/completions", {}, deep),
        ("/v1/completions", {}, b'{"prompt": "a", "top_k": 100000000000000000000000}'),
        ("/v1/completions", {}, b'{"prompt": "a", "priority": -100000000000000000000000}'),
        ("/v1/completions", {}, b'{"prompt": "a", "stop_token_ids": [1e400]}'),
        ("/v1/completions", {}, b'{"prompt": "a", "n": 1000000}'),
        ("/v1/completions", {}, b'{"prompt": "a", "max_tokens": -1}'),
        ("/v1/completions", {}, b'{"prompt": "a", "logit_bias": {"1": 5}}'),
        ("/v1/completions", {"content-type": "text/plain"}, b'{"prompt": "a"}'),
        ("/v1/chat/completions", {}, b'{"messages": [{"role": "user"}]}'),
        ("/v1/completions", {}, b'{"prompt": "' + b"a" * int((body_mb + 1) * (1 << 20)) + b'"}'),
    ]
    cases = list(fixed)
    fields = [b'"prompt"', b'"max_tokens"', b'"n"', b'"temperature"', b'"stop"', b'"messages"']
    values = [b"null", b"-1", b"1e309", b'"x"', b"[]", b"{}", b"[[[]]]", b"true", b"99999999999"]
    while len(cases) < n:
        kind = rng.randrange(3)
        if kind == 0:
            body = rng.randbytes(rng.randrange(1, 200))
        else:
            pairs = [rng.choice(fields) + b": " + rng.choice(values) for _ in range(3)]
            body = b"{" + b", ".join(pairs) + b"}"
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        cases.append((path, {}, body))
    return cases


async def probe_http_fuzz(http: httpx.AsyncClient, n: int, body_mb: float) -> Row:
    counts: dict[int, int] = {}
    gate = asyncio.Semaphore(16)

    async def one(path: str, headers: dict, body: bytes) -> None:
        async with gate:
            try:
                status = (await http.post(path, content=body, headers=headers)).status_code
            except httpx.HTTPError:
                status = 0
            counts[status] = counts.get(status, 0) + 1

    cases = _http_cases(random.Random(0), n, body_mb)
    await asyncio.gather(*(one(*case) for case in cases))
    server_errors = sum(v for k, v in counts.items() if k >= 500 or k == 0)
    return {"probe": "malformed HTTP", "requests": n, "by_status": dict(sorted(counts.items())),
            "server_errors": server_errors, "ok": server_errors == 0}  # fmt: skip


async def probe_zmq_frames(endpoint: str, http: httpx.AsyncClient, n: int) -> Row:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    encode = msgspec.msgpack.encode
    await sock.send(encode(HelloJob()))
    rng = random.Random(1)
    valid = encode(SubmitJob("j", "hi", params=SamplingParams(max_tokens=1)))
    frames = [b"\x91" * 1000 + b"\xc0", b"\xdd\xff\xff\xff\xff", b""]
    while len(frames) < n:
        if rng.random() < 0.5:
            frames.append(rng.randbytes(rng.randrange(1, 100)))
        else:
            flipped = bytearray(valid)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            frames.append(bytes(flipped))
    for frame in frames:
        await sock.send(frame)
    replies: dict[str, int] = {}
    while await sock.poll(2000):
        raw = msgspec.msgpack.decode(await sock.recv())
        kind = raw[0] if isinstance(raw, list) and raw else "?"
        code = f" {raw[2]}" if kind == "error" and len(raw) > 2 else ""
        replies[f"{kind}{code}"] = replies.get(f"{kind}{code}", 0) + 1
    await sock.send(encode(PingJob(7)))
    pong = await sock.poll(5000) and msgspec.msgpack.decode(await sock.recv())
    sock.close()
    ctx.term()
    health = (await http.get("/health")).status_code
    alive = bool(pong) and health == 200
    return {"probe": "bad ZeroMQ frames", "frames": len(frames), "replies": replies,
            "ping_after": bool(pong), "health_after": health, "ok": alive}  # fmt: skip


async def _settled_used_blocks(http: httpx.AsyncClient, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        m = await _metrics(http)
        idle = not m.get("num_requests_running") and not m.get("num_requests_waiting")
        if idle or time.monotonic() > deadline:
            return m.get("kv_blocks_total", 0.0) - m.get("kv_blocks_free", 0.0)
        await asyncio.sleep(0.2)


async def probe_disconnects(http: httpx.AsyncClient, n: int) -> Row:
    gate = asyncio.Semaphore(8)
    body = {"prompt": "Tell me a long story", "max_tokens": 32, "stream": True,
            "ignore_eos": True}  # fmt: skip

    async def one() -> None:
        async with gate, http.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            async for _ in response.aiter_lines():
                chunks += 1
                if chunks >= 3:
                    break  # leave mid-stream: the connection closes here

    await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    used = await _settled_used_blocks(http)
    return {"probe": "mid-stream disconnects", "streams": n, "kv_blocks_used_after": used,
            "ok": used == 0}  # fmt: skip


async def probe_flood(http: httpx.AsyncClient, concurrency: int) -> Row:
    refusals: list[float] = []
    statuses: dict[int, int] = {}
    health: list[float] = []
    retry_after = 0
    flooding = True

    async def one(body: dict) -> None:
        nonlocal retry_after
        started = time.perf_counter()
        try:
            response = await http.post("/v1/completions", json=body, timeout=300)
            status = response.status_code
            retry_after += status == 503 and "retry-after" in response.headers
        except httpx.HTTPError:
            status = 0
        if status == 503:
            refusals.append(time.perf_counter() - started)
        statuses[status] = statuses.get(status, 0) + 1

    def poll_health() -> None:
        """Every 20 ms on its own thread and socket, so the flood's client work in
        this event loop does not add to the figures (the GIL still can, by ~5 ms)."""
        port = int(str(http.base_url).rstrip("/").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while flooding:
                started = time.perf_counter()
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
                answer = b""
                while not answer.endswith(b"}"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        return
                    answer += chunk
                health.append(time.perf_counter() - started)
                time.sleep(0.02)

    async def one_at_a_time() -> None:
        """Once the burst is answered and the queue is still full: single refusals,
        without the burst's own HTTP work in front of them."""
        while sum(statuses.values()) < len(bodies) - 40:
            await asyncio.sleep(0.01)
        for _ in range(20):
            started = time.perf_counter()
            response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            if response.status_code == 503:
                single.append(time.perf_counter() - started)

    single: list[float] = []
    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    # long enough that the admitted requests still fill the queue for the single refusals
    bodies = [{"prompt": f"flood {i}", "max_tokens": 64} for i in range(concurrency)]
    bodies += [{"prompt": "wide", "max_tokens": 4, "n": 128},
               {"prompt": ["many"] * 200, "max_tokens": 4}]  # fmt: skip
    await asyncio.gather(one_at_a_time(), *(one(body) for body in bodies))
    flooding = False
    poller.join(5)
    slow = max(single, default=0.0)
    return {"probe": "flood", "requests": len(bodies), "by_status": dict(sorted(statuses.items())),
            "burst_refusal_latency": _ms(refusals), "single_refusal_latency": _ms(single),
            "single_refusal_max_s": round(slow, 3),
            "retry_after_headers": retry_after, "health_latency": _ms(health),
            "health_max_s": round(max(health, default=0.0), 3),
            "health_probes": len(health),
            "ok": bool(single) and slow < 0.05 and _p99(health) < 0.05}  # fmt: skip


def _in_engine(metrics: httpx.Response) -> int:
    """Requests running plus waiting, from a /metrics answer."""
    total = 0.0
    for line in metrics.text.splitlines():
        if line.startswith(("tokenloom_num_requests_running ", "tokenloom_num_requests_waiting ")):
            total += float(line.split()[1])
    return int(total)


async def probe_refusal_burst(http: httpx.AsyncClient, n: int, capacity: int) -> Row:
    """The queue filled with ``capacity`` long requests (topped up while the engine's
    own waiting limit refuses some of them), then ``keep_alive_burst``."""
    port = int(str(http.base_url).rstrip("/").rsplit(":", 1)[1])
    long = {"prompt": "fill", "max_tokens": 400, "ignore_eos": True}
    fill: list[asyncio.Future[httpx.Response]] = []
    try:
        deadline = time.monotonic() + 60
        while _in_engine(await http.get("/metrics")) < capacity:
            if time.monotonic() > deadline:
                return {"probe": "refusal burst", "skipped": "the queue never filled", "ok": None}
            live = sum(not task.done() for task in fill)
            fill += [asyncio.ensure_future(http.post("/v1/completions", json=long, timeout=600))
                     for _ in range(capacity - live)]  # fmt: skip
            await asyncio.sleep(0.2)
        result = await asyncio.to_thread(keep_alive_burst, port, n)
    finally:
        for task in fill:
            task.cancel()
        await asyncio.gather(*fill, return_exceptions=True)
        deadline = time.monotonic() + 60  # the aborted fill drains before the next probe
        while _in_engine(await http.get("/metrics")) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    latencies = result["latencies"]
    return {"probe": "refusal burst", "requests": n, "by_status": result["statuses"],
            "refusal_latency": _ms(latencies),
            "refusal_max_s": round(max(latencies, default=0.0), 3),
            "ok": result["statuses"] == {"503": n} and _p99(latencies) < 0.05}  # fmt: skip


async def probe_engine_kill(http: httpx.AsyncClient, server_pid: int | None) -> Row:
    engine = _engine_pid(server_pid) if server_pid else None
    if engine is None:
        return {"probe": "engine kill", "skipped": "no engine-core pid", "ok": None}
    os.kill(engine, signal.SIGKILL)
    killed = time.perf_counter()
    saw_503 = False
    while time.perf_counter() - killed < 120:
        try:
            status = (await http.get("/health")).status_code
        except httpx.HTTPError:
            status = 0
        saw_503 |= status == 503
        if saw_503 and status == 200:
            break
        await asyncio.sleep(0.05)
    restart_s = time.perf_counter() - killed
    body = {"prompt": "after", "max_tokens": 2}
    after = (await http.post("/v1/completions", json=body, timeout=60)).status_code
    return {"probe": "engine kill", "saw_503": saw_503, "restart_s": round(restart_s, 2),
            "completion_after": after, "ok": saw_503 and after == 200}  # fmt: skip


async def probe_soak(http: httpx.AsyncClient, server_pid: int | None, seconds: float) -> Row:
    served = errors = 0
    samples: list[tuple[float, float, float]] = []  # (t, frontend MB, engine MB)
    end = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal served, errors
        while time.perf_counter() < end:
            body = {"prompt": f"soak {i} {served}", "max_tokens": 8, "stream": i % 2 == 0}
            try:
                ok = (await http.post("/v1/completions", json=body, timeout=60)).status_code == 200
            except httpx.HTTPError:
                ok = False
            served += ok
            errors += not ok

    async def sample() -> None:
        engine = _engine_pid(server_pid) if server_pid else None
        while time.perf_counter() < end:
            if server_pid:
                t = time.perf_counter()
                samples.append((t, _rss_mb(server_pid), _rss_mb(engine) if engine else 0.0))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample(), *(worker(i) for i in range(4)))
    slopes = [_slope([(t, m[k]) for t, *m in samples]) * 60 for k in (0, 1)] if samples else []
    return {"probe": "soak", "seconds": seconds, "served": served, "errors": errors,
            "rss_mb_per_min": [round(s, 2) for s in slopes],
            "rss_mb_end": [round(v, 1) for v in samples[-1][1:]] if samples else [],
            "ok": errors == 0}  # fmt: skip


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


async def probe_open_endpoints(
    http: httpx.AsyncClient, server_pid: int | None, seconds: float = 5.0
) -> Row:
    """CPU the server spends while one client loops on each open endpoint (keep-alive,
    back to back), and the requests per second it got."""
    if not server_pid:
        return {"probe": "open endpoints", "skipped": "no server pid", "ok": None}
    port = int(str(http.base_url).rstrip("/").rsplit(":", 1)[1])
    engine = _engine_pid(server_pid)
    figures = {}
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        before = (_cpu_s(server_pid), _cpu_s(engine) if engine else 0.0, time.perf_counter())
        count = await asyncio.to_thread(_loop_on, port, path, seconds)
        elapsed = time.perf_counter() - before[2]
        frontend = 100 * (_cpu_s(server_pid) - before[0]) / elapsed
        engine_pct = 100 * ((_cpu_s(engine) if engine else 0.0) - before[1]) / elapsed
        figures[path] = (f"{count / elapsed:.0f} req/s, frontend CPU {frontend:.0f}%, "
                         f"engine-core {engine_pct:.1f}%")  # fmt: skip
    worst = max(float(v.split("frontend CPU ")[1].split("%")[0]) for v in figures.values())
    return {"probe": "open endpoints", "seconds_each": seconds, **figures,
            "ok": worst < 25}  # fmt: skip


def _loop_on(port: int, path: str, seconds: float) -> int:
    request = f"GET {path} HTTP/1.1\r\nHost: a\r\n\r\n".encode()
    count = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(request)
            read_response(sock)
            count += 1
    return count


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
