"""``tokenloom.serve``: start-up, the capacity log, and a graceful SIGTERM that lets an
in-flight request finish and leaves no engine-core process behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from tokenloom.config import make_config
from tokenloom.protocols.control import Ready
from tokenloom.serve import log_capacity, run

FAKES_DIR = Path(__file__).parents[1] / "plugins" / "frontends"

SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, {fakes!r})
    from serving_fakes import make_fake_engine
    from tokenloom.config import make_config
    from tokenloom.serve import run

    def started(handle):
        print("ENGINE", handle.supervisor.pid, flush=True)

    if __name__ == "__main__":
        config = make_config(json.loads({config!r}))
        code = asyncio.run(run(config, engine_factory=make_fake_engine, on_started=started,
                               handle_signals=True))
        print("EXIT", code, flush=True)
        sys.exit(code)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_finishes_in_flight_requests_then_exits_cleanly(tiny_model_factory, tmp_path):
    port = _free_port()
    config = {
        "model": str(tiny_model_factory("llama")), "port": port, "frontends": ["openai"],
        "max_model_len": 256, "shutdown_grace_s": 5.0, "plugin": {"fake": {"step_s": 0.01}},
    }  # fmt: skip
    script = tmp_path / "serve_fake.py"
    script.write_text(SERVER_SCRIPT.format(fakes=str(FAKES_DIR), config=json.dumps(config)))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ENGINE"), line
        engine_pid = int(line.split()[1])
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.05)
        result: dict = {}

        def in_flight() -> None:
            body = {"prompt": "x", "max_tokens": 100, "ignore_eos": True}
            result["response"] = httpx.post(base + "/v1/completions", json=body, timeout=30)

        worker = threading.Thread(target=in_flight)
        worker.start()
        time.sleep(0.3)  # the request runs for about 1 s
        proc.send_signal(signal.SIGTERM)
        worker.join(30)
        response = result["response"]
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        assert "EXIT 0" in proc.stdout.read()
        assert not _pid_exists(engine_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_unknown_frontend_fails_start_up_before_the_engine_starts(tiny_model_factory):
    config = make_config({"model": str(tiny_model_factory("llama")), "frontends": ["telnet"]})
    assert await run(config) == 1


def test_capacity_log_names_blocks_tokens_and_sequences(caplog):
    config = make_config({"model": "/m", "max_num_seqs": 8})
    ready = Ready(pid=1, max_model_len=1000, num_blocks=200, block_size=16, max_num_seqs=8)
    root = logging.getLogger("tokenloom")
    propagate, root.propagate = root.propagate, True  # let caplog see it
    try:
        with caplog.at_level(logging.INFO, logger="tokenloom.serve"):
            log_capacity(config, ready)
    finally:
        root.propagate = propagate
    message = caplog.records[-1].getMessage()
    assert "200 blocks x 16 = 3200 tokens" in message
    assert "3 sequences of max_model_len fit at once" in message  # 200 // ceil(1000 / 16)
