"""The OpenAI frontend's ``num_speculative_tokens`` extra (issue 11): a request's own
drafts per step, in ``[0, the server's num_speculative_tokens]``, on completions and
chat alike; out of range is a 400 naming the field, not a silent cap."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import server_config
from serving_fakes import ServerThread

from tokenloom.config import EngineConfig
from tokenloom.plugins.frontends.openai.schemas import (
    RequestError,
    decode_chat,
    decode_completion,
    request_params,
)

SPEC = EngineConfig(proposer="ngram", num_speculative_tokens=4)
PLAIN = EngineConfig()


def _completion(**fields):
    return decode_completion(json.dumps({"prompt": "x", **fields}).encode())


def _chat(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_chat(json.dumps(body).encode())


@pytest.mark.parametrize("decode", [_completion, _chat])
@pytest.mark.parametrize("value", [None, 0, 1, 4])
def test_a_value_in_range_reaches_sampling_params(decode, value) -> None:
    fields = {} if value is None else {"num_speculative_tokens": value}
    assert request_params(decode(**fields), SPEC).num_speculative_tokens == value


@pytest.mark.parametrize("decode", [_completion, _chat])
@pytest.mark.parametrize(("config", "value"), [(SPEC, 5), (SPEC, -1), (SPEC, 10**6), (PLAIN, 1)])
def test_out_of_range_is_refused_naming_the_field(decode, config, value) -> None:
    request = decode(num_speculative_tokens=value)
    with pytest.raises(RequestError) as error:
        request_params(request, config)
    assert error.value.param == "num_speculative_tokens"
    top = config.num_speculative_tokens
    assert f"[0, {top}]" in str(error.value)


def test_zero_is_accepted_without_speculation_and_a_wrong_type_refused() -> None:
    assert request_params(_completion(num_speculative_tokens=0), PLAIN).num_speculative_tokens == 0
    with pytest.raises(RequestError) as error:
        _completion(num_speculative_tokens="4")
    assert error.value.param == "num_speculative_tokens"


@pytest.fixture(scope="module")
def spec_server(served_model_dir):
    server = ServerThread(
        server_config(served_model_dir, proposer="ngram", num_speculative_tokens=4)
    ).start()
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3}),
    ],
)  # fmt: skip
def test_http_bodies_take_the_field_and_check_the_servers_limit(spec_server, path, body) -> None:
    with httpx.Client(base_url=spec_server.base_url, timeout=30) as client:
        for value in (0, 2, 4):
            ok = client.post(path, json={**body, "num_speculative_tokens": value})
            assert ok.status_code == 200, ok.text
        for value in (5, -1):
            bad = client.post(path, json={**body, "num_speculative_tokens": value})
            assert bad.status_code == 400
            error = bad.json()["error"]
            assert error["param"] == "num_speculative_tokens"
            assert "[0, 4]" in error["message"]
