"""Malformed and out-of-range requests: each gets a 4xx with an OpenAI error body that
names the field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from conftest import API_KEY

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]

# (path, body (dict, or raw bytes), expected status, expected "param" or None)
BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", 400, "body"),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 1]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": list(range(20, 320))}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 1000}, 400, "n"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, 400, "stop"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "x", "seed": "x"}, 400, "seed"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo"),
    (COMPLETIONS, {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    (CHAT, {"max_tokens": 3}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": OK_CHAT, "logprobs": 3}, 400, "logprobs"),
    # issue 15: integers past 64 bits were a 500 (OverflowError in serde.encode)
    (COMPLETIONS, {"prompt": "x", "top_k": 2**64}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "x", "top_k": 2**40}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "x", "priority": 10**30}, 400, "priority"),
    (COMPLETIONS, {"prompt": "x", "priority": -(10**30)}, 400, "priority"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    (CHAT, {"messages": OK_CHAT, "stop_token_ids": [-(2**70)]}, 400, "stop_token_ids"),
    # JSON nested 1,000 deep was a 500 (RecursionError), in any field
    (COMPLETIONS, b'{"prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "body"),
    (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "body"),
    # the shared limits
    (COMPLETIONS, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": list(range(17))}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": ["x"] * 257, "max_tokens": 1}, 400, "prompt"),
    # fields not implemented are refused, not ignored
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "x", "suffix": "tail"}, 400, "suffix"),
    (CHAT, {"messages": OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": OK_CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    (CHAT, {"messages": OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    # a chat message without content (OpenAI refuses it), or with an image part
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(live_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live_server.base_url, headers=headers, timeout=30) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def test_the_table_has_at_least_twenty_cases():
    assert len(BAD_REQUESTS) >= 20


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_naming_the_field(http, path, body, status, param):
    response = _post(http, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] is None
    assert error["message"]
    if param is not None:
        assert param.split("[")[0] in error["message"]


def test_server_still_serves_after_every_bad_request(http):
    for path, body, _, _ in BAD_REQUESTS:
        _post(http, path, body)
    response = http.post(COMPLETIONS, json={"prompt": "still here", "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2


def test_no_op_values_of_unimplemented_fields_are_accepted(http):
    body = {"prompt": "x", "max_tokens": 2, "best_of": 1, "logit_bias": {}, "suffix": ""}
    assert http.post(COMPLETIONS, json=body).status_code == 200
    body = {"messages": OK_CHAT, "max_tokens": 2, "response_format": {"type": "text"}, "tools": []}
    assert http.post(CHAT, json=body).status_code == 200


def test_unknown_fields_are_ignored(http):
    response = http.post(
        COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "suffix": None}
    )
    assert response.status_code == 200
    response = http.post(CHAT, json={"messages": OK_CHAT, "max_tokens": 2, "tools_extra": [1]})
    assert response.status_code == 200


def test_prompt_that_fills_the_model_length_without_max_tokens_is_refused(http):
    response = http.post(COMPLETIONS, json={"prompt": list(range(20, 276))})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
