"""Incremental detokenization: token ids in, newly completed text out.

Decoding each new token alone is wrong (a character can span several byte-level
tokens, and some tokenizers drop a token's leading space at the start of a string),
and decoding the whole output every step is quadratic. Instead the detokenizer keeps
a short window of ids: the "prefix" ids whose text was already emitted (context for
the next decode) and the pending ids after them. Each step decodes only the window;
the new text is what it adds to the prefix's text. When that text ends in U+FFFD the
last character is still incomplete, so it is held back until a later token completes
it. Once emitted, the pending ids become the next prefix, so the window stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tail used as the first prefix


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (``tokenloom.text.tokenizer.Tokenizer``
    and ``tokenizers.Tokenizer`` both fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams one sequence's text, token by token, never splitting a character.

    The first prefix is the tail of the prompt, so the first output token decodes in
    context (its leading space survives). With a byte-level tokenizer the
    concatenation of everything ``add`` and ``flush`` return equals
    ``tokenizer.decode(output_ids)``. Cost per token: at most two decodes of a window
    of a few tokens, independent of the sequence length.
    """

    __slots__ = ("_tokenizer", "_skip_special", "_window", "_read_offset", "_prefix_text")

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window: list[int] = context  # prefix ids, then pending ids
        self._read_offset = len(context)  # where the pending ids start in the window
        self._prefix_text = self._decode(context)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is
        still incomplete or the tokens decode to nothing, e.g. skipped specials)."""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is still held back, incomplete characters included (as
        U+FFFD). Call once when the sequence ends."""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        # The pending ids become the prefix of the next window.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
