"""Probe a tokenloom server as an attacker and a careless client would (issue 15).

Starts ``tokenloom serve`` on the CPU with the built-in model (or ``--model``), or
probes a running server (``--url``; the engine-kill probe then needs
``--server-pid``), and reports:

- malformed HTTP: counts by status (any 5xx is a failure);
- bad ZeroMQ frames (random, nested 1,000 deep, bit-flipped submits): replies, and
  whether the server still answers a ping and /health afterwards;
- mid-stream disconnects: KV blocks still used once the engine is idle (/metrics);
- a flood of concurrent requests against a small queue: 503 latency, and /health
  latency during the flood;
- a short soak: requests served and the RSS slope of both processes;
- open endpoints (/health, /v1/models, /version, /metrics) each looped on by one client:
  the server's CPU and the rate it got;
- engine-core SIGKILL: time until /health answers 200 again, and a completion after.

The probes live in ``scripts/abuse_probes.py``; this file starts the server, runs
them and writes the report.

Prints a table and writes JSON (``--out``). The default run takes about 2-3 minutes.
Usage: ``.venv/bin/python scripts/abuse.py [--model DIR] [--concurrency 500]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from abuse_probes import (
    Row,
    free_port,
    probe_disconnects,
    probe_engine_kill,
    probe_flood,
    probe_http_fuzz,
    probe_open_endpoints,
    probe_refusal_burst,
    probe_soak,
    probe_zmq_frames,
)

# ----------------------------------------------------------------- driver


def _summary(row: Row) -> str:
    return ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("probe", "ok"))


async def probe_all(args: argparse.Namespace, base: str, zmq_ep: str, pid: int | None) -> list[Row]:
    limits = httpx.Limits(max_connections=args.concurrency + 32)
    probes = {
        "fuzz": lambda: probe_http_fuzz(http, args.fuzz, args.max_request_body_mb),
        "zmq": lambda: probe_zmq_frames(zmq_ep, http, args.zmq_frames),
        "disconnects": lambda: probe_disconnects(http, args.disconnects),
        "flood": lambda: probe_flood(http, args.concurrency),
        "refusals": lambda: probe_refusal_burst(http, args.refusals, args.capacity),
        "soak": lambda: probe_soak(http, pid, args.soak_s),  # before the kill: a warm engine
        "open": lambda: probe_open_endpoints(http, pid, args.open_s),
        "kill": lambda: probe_engine_kill(http, pid),
    }
    chosen = args.probes.split(",") if args.probes else list(probes)
    if unknown := set(chosen) - set(probes):
        raise SystemExit(f"unknown probes {sorted(unknown)}; known: {', '.join(probes)}")
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        for name in probes:  # in this order whatever the order asked
            if name in chosen and (name != "zmq" or zmq_ep):
                rows.append(await probes[name]())
    return rows


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    port, zport = free_port(), free_port()
    cmd = [sys.executable, "-m", "tokenloom", "serve", "--device", "cpu", "--port", str(port),
           "--frontends", "openai,zmq", "--zmq-endpoint", f"tcp://127.0.0.1:{zport}",
           "--max-num-seqs", "8", "--max-waiting-requests", "16", "--max-model-len", "512"]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    log = open(args.log, "wb")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(base + "/health").status_code == 200:
                return proc, base, f"tcp://127.0.0.1:{zport}"
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start; see {args.log}")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="probe this server instead of starting one")
    parser.add_argument("--zmq-endpoint", default="", help="with --url: its job endpoint")
    parser.add_argument("--server-pid", type=int, help="with --url: for the kill and RSS")
    parser.add_argument("--model", help="model for the server this script starts")
    parser.add_argument("--fuzz", type=int, default=300)
    parser.add_argument("--zmq-frames", type=int, default=200)
    parser.add_argument("--disconnects", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--probes", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--refusals", type=int, default=2000, help="keep-alive refusal burst")
    parser.add_argument("--capacity", type=int, default=24, help="running + waiting sequences")
    parser.add_argument("--soak-s", type=float, default=30.0)
    parser.add_argument("--open-s", type=float, default=5.0, help="seconds per open endpoint")
    parser.add_argument("--max-request-body-mb", type=float, default=16.0)
    parser.add_argument("--log", default="/tmp/tokenloom-abuse-server.log")
    parser.add_argument("--out", default="docs/results/abuse.json")
    args = parser.parse_args()
    proc = None
    started = time.perf_counter()
    if args.url:
        base, zmq_ep, pid = args.url, args.zmq_endpoint, args.server_pid
    else:
        proc, base, zmq_ep = _start_server(args)
        pid = proc.pid
    try:
        rows = asyncio.run(probe_all(args, base, zmq_ep, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print("| probe | ok | result |\n|---|---|---|")
    for row in rows:
        print(f"| {row['probe']} | {row['ok']} | {_summary(row)} |")
    result = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
              "python": platform.python_version(), "argv": sys.argv[1:],
              "seconds": round(time.perf_counter() - started, 1), "probes": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0 if all(row["ok"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
