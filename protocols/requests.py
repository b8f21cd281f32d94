"""Frontend -> engine-core messages (socket ``engine-input``).

Field order is the wire format: append fields only. ``EngineInput`` is the tagged
union decoded by one decoder on the engine side.
"""

from __future__ import annotations

import msgspec

from tokenloom.protocols.sampling import SamplingParams


class GenerateRequest(
    msgspec.Struct, tag="generate", array_like=True, omit_defaults=True, gc=False
):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = []  # the model's end-of-sequence ids (ignored with ignore_eos)
    priority: int = 0  # lower runs first; ties by arrival
    arrival_time: float = 0.0  # time.monotonic() of the sender; 0 = on receipt
    deadline: float | None = None  # seconds after arrival; the engine aborts it past that
    tenant: str = ""  # who asked (OpenAI ``user``, a ZeroMQ job's tenant); schedulers may use it
    metadata: dict[str, str] = {}  # free-form, for scheduling policies and observers


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True, gc=False):
    request_ids: list[str]


class HealthRequest(msgspec.Struct, tag="health", array_like=True, omit_defaults=True, gc=False):
    nonce: int = 0


class StatsRequest(msgspec.Struct, tag="stats", array_like=True, omit_defaults=True, gc=False):
    nonce: int = 0


EngineInput = GenerateRequest | AbortRequest | HealthRequest | StatsRequest
