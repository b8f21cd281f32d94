"""Request decoding and SamplingParams translation of the OpenAI frontend (no server)."""

from __future__ import annotations

import json

import pytest

from tokenloom.plugins.frontends.limits import ModelLimits
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.plugins.frontends.openai.schemas import (
    RequestError,
    decode_chat,
    decode_completion,
    sampling_params,
)
from tokenloom.protocols.outputs import EngineStats

LIMITS = ModelLimits(max_model_len=100, vocab_size=0, eos_token_ids=[])


def _completion(**fields):
    return decode_completion(json.dumps({"prompt": "x", **fields}).encode())


def test_every_sampling_field_reaches_sampling_params():
    req = _completion(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, max_tokens=7, min_tokens=2,
        stop="END", stop_token_ids=[9], ignore_eos=True, logprobs=2,
    )  # fmt: skip
    params = sampling_params(req, num_prompt_tokens=3, limits=LIMITS)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (2, 0.5, 0.9, 5)
    assert (params.min_p, params.seed, params.repetition_penalty) == (0.1, 3, 1.2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.max_tokens, params.min_tokens, params.stop) == (7, 2, ["END"])
    assert (params.stop_token_ids, params.ignore_eos, params.logprobs) == ([9], True, 2)


def test_missing_max_tokens_uses_the_rest_of_the_model_length():
    params = sampling_params(_completion(), num_prompt_tokens=30, limits=LIMITS)
    assert params.max_tokens == 70


def test_chat_max_completion_tokens_wins_and_logprobs_map_to_top_logprobs():
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4,
    }  # fmt: skip
    params = sampling_params(decode_chat(json.dumps(body).encode()), 3, LIMITS)
    assert params.max_tokens == 9
    assert params.logprobs == 4


def test_chat_without_logprobs_asks_for_none():
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 4}
    assert sampling_params(decode_chat(json.dumps(body).encode()), 3, LIMITS).logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"max_tokens": 98}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"n": 0}, "n")],
)
def test_out_of_range_values_name_their_field(fields, param):
    with pytest.raises(RequestError) as info:
        sampling_params(_completion(**fields), num_prompt_tokens=3, limits=LIMITS)
    assert info.value.param == param
    assert info.value.body()["error"]["param"] == param


def test_latency_histograms_are_cumulative_prometheus_buckets():
    metrics = ServingMetrics()
    for value in (0.05, 0.5, 0.7, 5.0):
        metrics.ttft.observe(value)
    lines = metrics.render(None, engine_alive=False).decode().splitlines()
    name = "tokenloom_time_to_first_token_seconds"
    assert f'{name}_bucket{{le="0.1"}} 1.0' in lines
    assert f'{name}_bucket{{le="1.0"}} 3.0' in lines
    assert f'{name}_bucket{{le="+Inf"}} 4.0' in lines
    assert f"{name}_count 4.0" in lines
    assert "tokenloom_engine_alive 0.0" in lines
    assert not any("_created" in line for line in lines)


def test_metrics_render_engine_gauges_and_hit_rate():
    metrics = ServingMetrics()
    metrics.record_finished("stop", prompt_tokens=10, generated=4)
    stats = EngineStats(
        num_waiting=2, num_blocks_total=10, num_blocks_free=4, prefix_cache_queries=8,
        prefix_cache_hits=2,
    )  # fmt: skip
    text = metrics.render(stats, engine_alive=True).decode()
    assert "tokenloom_num_requests_waiting 2.0" in text
    assert "tokenloom_kv_cache_usage_ratio 0.6" in text
    assert "tokenloom_prefix_cache_hit_rate 0.25" in text
    assert 'tokenloom_request_success_total{finished_reason="stop"} 1.0' in text
    assert "tokenloom_generation_tokens_total 4.0" in text
