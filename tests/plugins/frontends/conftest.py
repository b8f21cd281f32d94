"""A live server on loopback for the frontend tests: the real serve/supervisor/engine
client/frontends stack around a deterministic fake engine (``serving_fakes``)."""

from __future__ import annotations

import pytest
from serving_fakes import ServerThread

from tokenloom.config import make_config

API_KEY = "test-key"


def server_config(model_dir: object, **overrides: object):
    options = {
        "model": str(model_dir),
        "port": 0,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "frontends": ["openai", "zmq"],
        "max_model_len": 256,
        "block_size": 16,
        "num_blocks": 512,
        "shutdown_grace_s": 2.0,
        **overrides,
    }
    return make_config(options)


@pytest.fixture(scope="session")
def served_model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def live_server(served_model_dir):
    """One server for the session, with an API key (``API_KEY``)."""
    server = ServerThread(server_config(served_model_dir, api_key=API_KEY)).start()
    yield server
    assert server.stop() == 0
