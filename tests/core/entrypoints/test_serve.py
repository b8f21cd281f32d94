"""``tokenloom.entrypoints.serve``: start-up, the capacity log, a graceful SIGTERM that lets an
in-flight request finish and leaves no engine-core process behind, and failures kept
contained: a failing frontend is served again while the others serve on, a killed
engine-core is restarted, and one that keeps failing makes ``run`` exit non-zero."""

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
from tokenloom.entrypoints.serve import log_capacity, run
from tokenloom.protocols.control import Ready

FAKES_DIR = Path(__file__).parents[2] / "plugins" / "frontends"
if str(FAKES_DIR) not in sys.path:
    sys.path.insert(0, str(FAKES_DIR))  # serving_fakes, here and in spawned engine-cores

SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, {fakes!r})
    from serving_fakes import fake_plugins, make_fake_engine
    from tokenloom.config import make_config
    from tokenloom.entrypoints.serve import run

    def started(handle):
        print("ENGINE", handle.supervisor.pid, flush=True)

    if __name__ == "__main__":
        config = make_config(json.loads({config!r}))
        code = asyncio.run(run(config, engine_factory=make_fake_engine, on_started=started,
                               handle_signals=True, plugins=fake_plugins()))
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
        with caplog.at_level(logging.INFO, logger="tokenloom.entrypoints.serve"):
            log_capacity(config, ready)
    finally:
        root.propagate = propagate
    message = caplog.records[-1].getMessage()
    assert "200 blocks x 16 = 3200 tokens" in message
    assert "3 sequences of max_model_len fit at once" in message  # 200 // ceil(1000 / 16)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _health(base: str) -> int:
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def test_a_failing_frontend_is_served_again_while_the_others_keep_serving(
    tiny_model_factory, monkeypatch
):
    from serving_fakes import ServerThread

    from tokenloom.plugins.frontends.zmq.frontend import ZmqFrontend

    calls = []
    original = ZmqFrontend.serve

    async def flaky_serve(self):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise RuntimeError("bad frame")  # what one malformed frame once did
        await original(self)

    monkeypatch.setattr(ZmqFrontend, "serve", flaky_serve)
    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "frontends": ["openai", "zmq"],
         "zmq_endpoint": "tcp://127.0.0.1:0", "max_model_len": 128}
    )  # fmt: skip
    server = ServerThread(config).start()
    try:
        _wait_for(lambda: len(calls) >= 3, 10, "the failed frontend was not served again")
        assert _health(server.base_url) == 200
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
    finally:
        assert server.stop() == 0


def test_a_killed_engine_core_is_restarted_and_the_next_request_succeeds(tiny_model_factory):
    from serving_fakes import ServerThread

    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "frontends": ["openai"],
         "device": "cpu", "max_model_len": 128, "max_engine_restarts": 2}
    )  # fmt: skip
    server = ServerThread(config, engine_factory=None).start(timeout_s=120)  # the real engine
    try:
        base = server.base_url
        old_pid = server.engine_pid
        os.kill(old_pid, signal.SIGKILL)
        _wait_for(lambda: _health(base) == 503, 5, "/health did not answer 503")
        _wait_for(lambda: _health(base) == 200, 120, "the engine-core was not restarted")
        assert server.engine_pid != old_pid
        body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0


def test_an_engine_core_that_cannot_be_restarted_makes_serve_exit_non_zero(
    tiny_model_factory, monkeypatch, tmp_path
):
    from restart_fakes import make_engine_once
    from serving_fakes import ServerThread

    monkeypatch.setenv("TOKENLOOM_TEST_START_MARKER", str(tmp_path / "started"))
    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "frontends": ["openai"],
         "max_model_len": 128, "max_engine_restarts": 1}
    )  # fmt: skip
    server = ServerThread(config, engine_factory=make_engine_once).start()
    os.kill(server.engine_pid, signal.SIGKILL)
    server._thread.join(30)  # death, one failed restart: more than max_engine_restarts
    assert not server._thread.is_alive() and server.exit_code == 1


def test_without_restart_engine_a_dead_engine_core_makes_serve_exit_non_zero(
    tiny_model_factory,
):
    from serving_fakes import ServerThread

    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "frontends": ["openai"],
         "max_model_len": 128, "restart_engine": False}
    )  # fmt: skip
    server = ServerThread(config).start()
    os.kill(server.engine_pid, signal.SIGKILL)
    server._thread.join(30)
    assert not server._thread.is_alive() and server.exit_code == 1


def test_recording_a_trace_around_a_given_engine_factory_passes_the_config_check(
    tiny_model_factory, tmp_path
):
    # with_recording names the wrapped factory in an internal [plugin.trace_recorder]
    # table; the check of [plugin.NAME] tables runs before it is added.
    from serving_fakes import ServerThread

    trace = tmp_path / "trace.jsonl"
    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "frontends": ["openai"],
         "max_model_len": 128, "record_trace": str(trace), "plugin": {"fake": {"step_s": 0.002}}}
    )  # fmt: skip
    server = ServerThread(config).start()
    try:
        body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
    finally:
        assert server.stop() == 0
    (line,) = [json.loads(line) for line in trace.read_text().splitlines()]
    assert (line["output_len"], line["finish_reason"]) == (3, "length")
