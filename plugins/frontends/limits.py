"""What the frontends check a prompt against, and the checks they share.

``ModelLimits.of`` takes the model length, EOS ids and vocabulary size from the
engine-core's ``Ready`` when it has them, else from the config and the tokenizer
(whose vocabulary may be smaller than the model's embedding). A prompt that cannot be served raises ``PromptError``
naming the request field at fault; each frontend turns it into its own reply.

``check_request_limits`` is the one check of a request's size and ranges that both
frontends run before any tokenization: ``n``, stop lists, prompt count and request id
against the config's limits, and every integer within what the wire (msgpack, signed
64-bit) and the engine accept, every float finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.protocols.control import Ready
from tokenloom.protocols.sampling import SamplingParams

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_TOP_K = (1 << 31) - 1  # torch.topk and the sampler's int32 buffers
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty",
)  # fmt: skip


class PromptError(ValueError):
    """A prompt the model cannot take; ``field`` names the request field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int  # 0: unknown, every prompt is refused
    vocab_size: int  # 0: unknown, token ids are not checked
    eos_token_ids: list[int]
    max_token_chars: int = 0  # the longest vocabulary entry; 0: unknown, text not bounded

    @classmethod
    def of(cls, config: EngineConfig, tokenizer: Any, ready: Ready | None = None) -> ModelLimits:
        max_model_len = (ready.max_model_len if ready else 0) or config.max_model_len or 0
        eos = list(ready.eos_token_ids) if ready and ready.eos_token_ids else []
        eos = eos or list(getattr(tokenizer, "eos_token_ids", []))
        vocab = (ready.vocab_size if ready else 0) or int(getattr(tokenizer, "vocab_size", 0) or 0)
        return cls(max_model_len, vocab, eos, _longest_token(tokenizer))

    def check_text_length(self, num_chars: int, field: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text too long to fit the model length
        whatever its tokens: no token covers more than ``max_token_chars`` characters
        (doubled for normalizers that merge characters). Tokenizing megabytes would
        hold the GIL for seconds only to refuse the prompt afterwards."""
        bound = 2 * self.max_model_len * self.max_token_chars
        if self.max_token_chars and num_chars > bound:
            raise PromptError(
                f"{num_chars} characters cannot fit the model length {self.max_model_len}",
                field,
            )

    def check_token_ids(self, ids: Sequence[int], field: str = "prompt") -> None:
        """Refuse ids outside the vocabulary (a client's own token ids)."""
        vocab = self.vocab_size
        if vocab and not all(0 <= t < vocab for t in ids):
            raise PromptError(f"token ids must be in [0, {vocab})", field)

    def output_room(
        self, num_prompt_tokens: int, max_tokens: int | None, max_tokens_field: str = "max_tokens"
    ) -> int:
        """The most tokens the output may have: ``max_tokens``, or with None the rest of
        the model length. Refuses an empty prompt, one that leaves no room, and a
        ``max_tokens`` that would run past the model length (one below 1 is returned
        for the sampling checks to refuse)."""
        if num_prompt_tokens == 0:
            raise PromptError("must not be empty", "prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise PromptError(
                f"{num_prompt_tokens} tokens leave no room in the model length "
                f"{self.max_model_len}",
                "prompt",
            )
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise PromptError(
                f"{num_prompt_tokens} prompt tokens + {max_tokens} exceed the model length "
                f"{self.max_model_len}",
                max_tokens_field,
            )
        return max_tokens


def check_request_limits(
    config: EngineConfig,
    params: SamplingParams,
    *,
    num_prompts: int = 1,
    request_id: str | None = None,
    priority: int = 0,
) -> None:
    """Refuse a request beyond the config's limits or the engine's ranges, before any
    work is done for it. Raises ``PromptError`` naming the field: ``n`` > ``max_n``,
    ``stop`` or ``stop_token_ids`` longer than ``max_stop_sequences``, more than
    ``max_prompts_per_request`` prompts (``prompt``), a ``request_id`` over
    ``max_request_id_bytes`` in UTF-8, an integer outside signed 64 bits (``top_k``
    above ``MAX_TOP_K``, token ids negative), a float that is not finite."""
    if num_prompts > config.max_prompts_per_request:
        raise PromptError(
            f"{num_prompts} prompts, at most {config.max_prompts_per_request}", "prompt"
        )
    if request_id is not None and len(request_id.encode()) > config.max_request_id_bytes:
        raise PromptError(f"longer than {config.max_request_id_bytes} bytes", "request_id")
    if params.n > config.max_n:
        raise PromptError(f"must be in [1, {config.max_n}]", "n")
    for name in ("stop", "stop_token_ids"):
        if len(getattr(params, name)) > config.max_stop_sequences:
            raise PromptError(f"at most {config.max_stop_sequences} entries", name)
    _check_int(params.top_k, "top_k", -1, MAX_TOP_K)
    _check_int(priority, "priority", INT64_MIN, INT64_MAX)
    for name in ("seed", "max_tokens", "min_tokens", "logprobs"):
        value = getattr(params, name)
        if value is not None:
            _check_int(value, name, INT64_MIN, INT64_MAX)
    for token in params.stop_token_ids:
        _check_int(token, "stop_token_ids", 0, INT64_MAX)
    for name in _FLOAT_FIELDS:
        if not math.isfinite(getattr(params, name)):
            raise PromptError("must be a finite number", name)


def _longest_token(tokenizer: Any) -> int:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if convert is None or not vocab:
        return 0
    return max((len(token) for token in convert(list(range(vocab))) if token), default=0)


def _check_int(value: int, field: str, low: int, high: int) -> None:
    if not low <= value <= high:
        raise PromptError(f"must be in [{low}, {high}]", field)
