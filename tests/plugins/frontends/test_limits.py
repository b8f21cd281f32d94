"""``ModelLimits``: where the frontends' model length, EOS ids and vocabulary size come
from, and the prompt checks both frontends share."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgspec
import pytest

from tokenloom.config import EngineConfig
from tokenloom.plugins.frontends.limits import ModelLimits, PromptError, check_request_limits
from tokenloom.protocols.control import Ready
from tokenloom.protocols.sampling import SamplingParams

TOKENIZER = SimpleNamespace(eos_token_ids=[2], vocab_size=50)
LIMITS = ModelLimits(max_model_len=10, vocab_size=50, eos_token_ids=[2])


def test_ready_wins_over_config_and_tokenizer():
    ready = Ready(pid=1, max_model_len=64, eos_token_ids=[7, 8])
    limits = ModelLimits.of(EngineConfig(max_model_len=32), TOKENIZER, ready)
    assert limits == ModelLimits(64, 50, [7, 8])


def test_without_ready_the_config_and_tokenizer_decide():
    assert ModelLimits.of(EngineConfig(max_model_len=32), TOKENIZER) == ModelLimits(32, 50, [2])
    assert ModelLimits.of(EngineConfig(), SimpleNamespace()) == ModelLimits(0, 0, [])


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field():
    LIMITS.check_token_ids([0, 49])
    with pytest.raises(PromptError) as info:
        LIMITS.check_token_ids([3, 50], "prompt_token_ids")
    assert info.value.field == "prompt_token_ids"
    assert str(info.value) == "prompt_token_ids: token ids must be in [0, 50)"
    ModelLimits(10, 0, []).check_token_ids([10**9])  # vocabulary unknown: not checked


def test_output_room_is_max_tokens_or_the_rest_of_the_model_length():
    assert LIMITS.output_room(4, 6) == 6
    assert LIMITS.output_room(4, None) == 6


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens", "field", "message"),
    [
        (0, None, "prompt", "must not be empty"),
        (10, None, "prompt", "10 tokens leave no room in the model length 10"),
        (4, 7, "max_completion_tokens", "4 prompt tokens + 7 exceed the model length 10"),
    ],
)
def test_a_prompt_that_cannot_fit_is_refused_naming_the_field(
    num_prompt_tokens, max_tokens, field, message
):
    with pytest.raises(PromptError) as info:
        LIMITS.output_room(num_prompt_tokens, max_tokens, "max_completion_tokens")
    assert info.value.field == field
    assert str(info.value) == f"{field}: {message}"


def test_the_model_vocabulary_from_ready_wins_over_the_tokenizers():
    ready = Ready(pid=1, max_model_len=64, vocab_size=64)
    limits = ModelLimits.of(EngineConfig(), TOKENIZER, ready)
    assert limits.vocab_size == 64
    limits.check_token_ids([63])  # past the tokenizer's 50, inside the model's embedding


CONFIG = EngineConfig(max_n=4, max_stop_sequences=2, max_prompts_per_request=3,
                      max_request_id_bytes=8)  # fmt: skip


@pytest.mark.parametrize(
    ("params", "kwargs", "field"),
    [
        (SamplingParams(n=5), {}, "n"),
        (SamplingParams(stop=["a", "b", "c"]), {}, "stop"),
        (SamplingParams(stop_token_ids=[1, 2, 3]), {}, "stop_token_ids"),
        (SamplingParams(), {"num_prompts": 4}, "prompt"),
        (SamplingParams(), {"request_id": "é" * 5}, "request_id"),
        (SamplingParams(top_k=1 << 63), {}, "top_k"),
        (SamplingParams(top_k=1 << 31), {}, "top_k"),
        (SamplingParams(stop_token_ids=[1 << 64]), {}, "stop_token_ids"),
        (SamplingParams(stop_token_ids=[-1]), {}, "stop_token_ids"),
        (SamplingParams(max_tokens=1 << 70), {}, "max_tokens"),
        (SamplingParams(min_tokens=1 << 70, max_tokens=None), {}, "min_tokens"),
        (SamplingParams(), {"priority": -(1 << 63) - 1}, "priority"),
        (SamplingParams(temperature=math.inf), {}, "temperature"),
        (SamplingParams(repetition_penalty=math.inf), {}, "repetition_penalty"),
    ],
)
def test_request_limits_refuse_naming_the_field(params, kwargs, field):
    with pytest.raises(PromptError) as info:
        check_request_limits(CONFIG, params, **kwargs)
    assert info.value.field == field


def test_request_limits_accept_the_edges():
    params = SamplingParams(n=4, stop=["a", "b"], stop_token_ids=[0, (1 << 63) - 1],
                            top_k=(1 << 31) - 1, seed=(1 << 63) - 1)  # fmt: skip
    check_request_limits(CONFIG, params, num_prompts=3, request_id="12345678", priority=1 << 62)


def test_out_of_range_ints_are_what_the_wire_cannot_carry():
    """The regression behind the int checks: such a request failed in serde.encode."""
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(SamplingParams(stop_token_ids=[1 << 64]))
