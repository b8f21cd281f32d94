"""Every message struct in tokenloom.protocols: field-order pins and round trips.

Field order is the wire format (array_like structs encode as arrays). A struct
whose fields change, or a new struct without a pin here, fails these tests: add
fields only at the end, then update the pin on purpose.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

import tokenloom.protocols
from tokenloom.transport.serde import Decoder, Encoder

PINS: dict[str, tuple[str, ...]] = {
    "control.Ready": (
        "pid",
        "model_name",
        "max_model_len",
        "num_blocks",
        "block_size",
        "max_num_seqs",
        "eos_token_ids",
        "vocab_size",
    ),
    "control.Shutdown": ("grace_s",),
    "control.Failed": ("message",),
    "jobs.SubmitJob": (
        "job_id",
        "prompt",
        "prompt_token_ids",
        "params",
        "priority",
        "tenant",
        "metadata",
        "include_metrics",
    ),
    "jobs.AbortJob": ("job_id",),
    "jobs.PingJob": ("nonce",),
    "jobs.HelloJob": ("api_key",),
    "jobs.JobWelcome": ("heartbeat_timeout_s", "max_message_bytes"),
    "jobs.JobOutput": ("job_id", "index", "text", "token_ids", "finish_reason", "logprobs"),
    "jobs.JobDone": ("job_id", "num_prompt_tokens", "num_generated_tokens", "metrics"),
    "jobs.JobMetrics": (
        "arrival_time",
        "queue_time",
        "time_to_first_token",
        "e2e_time",
        "num_preemptions",
        "num_cached_tokens",
    ),
    "jobs.JobError": ("job_id", "code", "message"),
    "jobs.JobPong": ("nonce", "engine_alive"),
    "outputs.TopLogprobs": ("token_ids", "logprobs"),
    "outputs.TokenDelta": (
        "request_id",
        "new_token_ids",
        "finish_reason",
        "logprobs",
        "top_logprobs",
        "num_prompt_tokens",
        "num_cached_tokens",
        "prompt_logprobs",
        "metrics",
    ),
    "outputs.RequestMetrics": (
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "num_preemptions",
        "num_cached_tokens",
    ),
    "outputs.EngineOutputs": ("outputs", "timestamp"),
    "outputs.ErrorReply": ("code", "message", "request_id"),
    "outputs.EngineStats": (
        "num_waiting",
        "num_running",
        "num_blocks_total",
        "num_blocks_free",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_steps",
        "spec_draft_tokens_total",
        "spec_accepted_tokens_total",
        "spec_verify_steps_total",
    ),
    "outputs.HealthReply": ("nonce", "ok"),
    "outputs.StatsReply": ("nonce", "stats"),
    "requests.GenerateRequest": (
        "request_id",
        "prompt_token_ids",
        "params",
        "eos_token_ids",
        "priority",
        "arrival_time",
        "deadline",
        "tenant",
        "metadata",
    ),
    "requests.AbortRequest": ("request_ids",),
    "requests.HealthRequest": ("nonce",),
    "requests.StatsRequest": ("nonce",),
    "sampling.SamplingParams": (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "skip_special_tokens",
        "prompt_logprobs",
        "num_speculative_tokens",
    ),
    "step.NewRequestData": ("request_id", "prompt_token_ids", "params", "eos_token_ids"),
    "step.ScheduledChunk": (
        "request_id",
        "token_ids",
        "start_pos",
        "block_ids",
        "sample",
        "num_draft_tokens",
    ),
    "step.StepInput": ("step_id", "chunks", "new_requests", "finished_request_ids", "num_tokens"),
    "step.StepOutput": (
        "step_id",
        "request_ids",
        "token_ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "draft_token_ids",
    ),
    "tensors.TensorRef": ("dtype", "shape", "frame"),
}


def all_structs() -> dict[str, type[msgspec.Struct]]:
    found: dict[str, type[msgspec.Struct]] = {}
    for info in pkgutil.iter_modules(tokenloom.protocols.__path__):
        module = importlib.import_module(f"tokenloom.protocols.{info.name}")
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, msgspec.Struct)
                and obj.__module__ == module.__name__
            ):
                found[f"{info.name}.{name}"] = obj
    return found


STRUCTS = all_structs()


def test_every_struct_has_a_pin_and_every_pin_a_struct() -> None:
    assert sorted(STRUCTS) == sorted(PINS)


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_field_order_matches_the_pin(name: str) -> None:
    assert STRUCTS[name].__struct_fields__ == PINS[name]


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_round_trips_with_every_field_set(name: str) -> None:
    struct = STRUCTS[name]
    msg = sample(mi.type_info(struct))
    frames = Encoder().encode(msg)
    assert len(frames) == 1
    assert Decoder(struct, 1 << 20).decode(frames) == msg


def sample(t: mi.Type) -> Any:
    """A value of type ``t`` that differs from the usual defaults (3, 0.5, "x", True),
    so that ``omit_defaults`` leaves every field on the wire."""
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: sample(f.type) for f in t.fields})
    if isinstance(t, mi.UnionType):
        return sample(next(m for m in t.types if not isinstance(m, mi.NoneType)))
    if isinstance(t, mi.ListType):
        return [sample(t.item_type)]
    if isinstance(t, mi.DictType):
        return {sample(t.key_type): sample(t.value_type)}
    simple = {mi.IntType: 3, mi.FloatType: 0.5, mi.StrType: "x", mi.BoolType: True}
    for kind, value in simple.items():
        if isinstance(t, kind):
            return value
    if isinstance(t, mi.AnyType):
        return 3
    raise TypeError(f"no sample for {t}")
