"""Sampling parameters: how one request chooses its next tokens.

Plain data shared by every channel that carries a request. Validation runs on
construction and on decode (msgspec calls ``__post_init__``), so an out-of-range
value is rejected where it enters, with the field's name in the message.
"""

from __future__ import annotations

import msgspec

MAX_SEED = 1 << 63  # torch generators take a signed 64-bit seed


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled one
    skip_special_tokens: bool = True
    prompt_logprobs: bool = False  # also return each prompt token's logprob (no prefix cache)
    # Speculative decoding: drafts verified per step for this request; None: the
    # engine's ``num_speculative_tokens``, 0: off. Capped by the engine's value.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self.n >= 1, "n", "must be >= 1")
        _check(
            self.seed is None or 0 <= self.seed < MAX_SEED, "seed", f"must be in [0, {MAX_SEED})"
        )
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be >= 0 (0 or -1: off)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(
            self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 64,
            "num_speculative_tokens",
            "must be in [0, 64]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(field, message)
