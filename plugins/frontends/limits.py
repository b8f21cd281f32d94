"""What the frontends check a prompt against, and the checks they share.

``ModelLimits.of`` takes the model length and EOS ids from the engine-core's
``Ready`` when it has them, else from the config and the tokenizer; the vocabulary
size comes from the tokenizer. A prompt that cannot be served raises ``PromptError``
naming the request field at fault; each frontend turns it into its own reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.protocols.control import Ready


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

    @classmethod
    def of(cls, config: EngineConfig, tokenizer: Any, ready: Ready | None = None) -> ModelLimits:
        max_model_len = (ready.max_model_len if ready else 0) or config.max_model_len or 0
        eos = list(ready.eos_token_ids) if ready and ready.eos_token_ids else []
        eos = eos or list(getattr(tokenizer, "eos_token_ids", []))
        return cls(max_model_len, int(getattr(tokenizer, "vocab_size", 0) or 0), eos)

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
