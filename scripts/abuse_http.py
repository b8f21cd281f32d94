"""Raw-socket HTTP for the abuse probes: reading one response, and the keep-alive
refusal burst (also run by tests/plugins/frontends/test_health_under_load.py)."""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any


def content_length(head: bytes) -> int:
    """The Content-Length of a response head (without its blank line)."""
    return int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from a blocking socket."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    while len(body) < content_length(head):
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def keep_alive_burst(port: int, n: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """N keep-alive connections, each served one /health first (a client's warm pool),
    then one completion request on each, sent as fast as one thread can; each timed
    from its send to the end of its response. Raw sockets and a selector, so the client
    adds little of its own. Returns the statuses and the sorted latencies (s)."""
    body = b'{"prompt": "hello", "max_tokens": 8}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    socks = [socket.create_connection((host, port)) for _ in range(n)]
    sel = selectors.DefaultSelector()
    sent: dict[socket.socket, float] = {}
    got: dict[socket.socket, bytes] = {}
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    try:
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            if not sock.recv(4096).startswith(b"HTTP/1.1 200 "):
                raise RuntimeError("a warm-up /health failed")
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
            got[sock] = b""

        def read(timeout: float) -> None:
            for key, _ in sel.select(timeout):
                sock = key.fileobj  # type: ignore[assignment]
                got[sock] += sock.recv(65536)
                head, sep, rest = got[sock].partition(b"\r\n\r\n")
                if sep and len(rest) >= content_length(head):
                    latencies.append(time.perf_counter() - sent[sock])
                    status = head.split(b" ")[1].decode()
                    statuses[status] = statuses.get(status, 0) + 1
                    sel.unregister(sock)

        # Responses that arrive while the client is still sending are read between
        # sends (every 32), so that a latency is not the client's own send loop.
        for i, sock in enumerate(socks):
            sent[sock] = time.perf_counter()
            sock.send(request)
            if i % 32 == 31:
                read(0)
        deadline = time.monotonic() + 60
        while len(latencies) < n and time.monotonic() < deadline:
            read(1)
    finally:
        for sock in socks:
            sock.close()
    return {"statuses": statuses, "latencies": sorted(latencies)}
