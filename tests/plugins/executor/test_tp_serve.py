"""``tokenloom serve -tp 2`` on the CPU: the OpenAI endpoint answers with TP=1's
greedy text; a killed worker fails the request in flight within 5 s with the reason,
the engine-core restarts with a fresh group and answers again, and stopping the
server leaves no worker behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
WORKER_MODULE = b"tokenloom.plugins.executor.parallel.worker"
ENGINE = {"device": "cpu", "dtype": "float32", "num_blocks": 64, "max_model_len": 256}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(root: int) -> dict[int, bytes]:
    """pid -> command line of every live (not zombie) descendant of ``root``."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
            cmdlines[int(entry)] = cmdline
    found: dict[int, bytes] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = cmdlines[child]
                frontier.append(child)
    return found


def _workers(root: int) -> list[int]:
    return [pid for pid, cmd in _descendants(root).items() if WORKER_MODULE in cmd]


def _wait_healthy(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, "server exited"
        try:
            if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("server not healthy in time")


def _complete(base: str, model: str, max_tokens: int) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(base + "/v1/completions", json=body, timeout=60.0)


def test_serve_tp2_answers_survives_a_dead_worker_and_leaves_no_process(tiny_model_factory):
    model_dir = str(tiny_model_factory("llama"))
    single = LLM(model_dir, **ENGINE)
    expected = single.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    single.shutdown()

    port = _free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    server = subprocess.Popen(
        # the module, not the console script: a --target install (the GPU host's) has none
        [sys.executable, "-m", "tokenloom", "serve", model_dir, "-tp", "2"]
        + flags
        + [f"--port={port}", "--frontends=openai"],
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server, 180.0)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        answer = _complete(base, model, 8).json()
        assert answer["choices"][0]["text"] == expected.text
        assert answer["usage"]["completion_tokens"] == 8
        first_workers = _workers(server.pid)
        assert len(first_workers) == 1

        # A long generation in flight; the worker dies; the request fails with the reason.
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 240,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=30.0,
        ) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # generating
            killed_at = time.monotonic()
            os.kill(first_workers[0], signal.SIGKILL)
            rest = "\n".join(lines)
        failed_after = time.monotonic() - killed_at
        assert failed_after < 5.0
        assert "worker rank 1" in rest and "killed by signal 9" in rest
        assert "[DONE]" not in rest or '"error"' in rest

        # The keeper restarts the engine-core with a new group; it answers again.
        deadline = time.monotonic() + 180.0
        while time.monotonic() < deadline:
            response = _complete(base, model, 8)
            if response.status_code == 200:
                break
            time.sleep(0.5)
        assert response.json()["choices"][0]["text"] == expected.text
        second_workers = _workers(server.pid)
        assert len(second_workers) == 1 and second_workers != first_workers
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30.0)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    time.sleep(1.0)  # the workers' parent-death watchdog polls every 0.5 s
    leftovers = [pid for pid in first_workers + second_workers if os.path.exists(f"/proc/{pid}")]
    assert not [pid for pid in leftovers if _is_live(pid)]


def _is_live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
