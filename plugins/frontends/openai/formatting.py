"""The OpenAI response bodies (plain dicts, encoded once by msgspec): choices, chunks,
usage and logprobs for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from tokenloom.plugins.frontends.generation import ChoiceUpdate


class TokenTexts:
    """Token id -> its text, cached (logprobs name every token they list)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class ChoiceLogprobs:
    """Accumulates one choice's logprobs across updates, in either endpoint's format."""

    __slots__ = ("chat", "texts", "tokens", "values", "tops", "offsets", "text_len")

    def __init__(self, chat: bool, texts: TokenTexts) -> None:
        self.chat = chat
        self.texts = texts
        self.tokens: list[str] = []
        self.values: list[float] = []
        self.tops: list[Any] = []
        self.offsets: list[int] = []
        self.text_len = 0

    def add(self, update: ChoiceUpdate) -> None:
        if update.logprobs is None:
            return
        for i, token_id in enumerate(update.token_ids):
            token = self.texts(token_id)
            self.tokens.append(token)
            self.values.append(update.logprobs[i])
            self.offsets.append(self.text_len)
            self.text_len += len(token)
            top = update.top_logprobs[i] if update.top_logprobs else None
            self.tops.append(self._top(top))

    def _top(self, top: Any) -> Any:
        if top is None:
            return [] if self.chat else None
        pairs = zip(top.token_ids, top.logprobs, strict=False)
        if self.chat:
            return [_chat_entry(self.texts(t), lp) for t, lp in pairs]
        return {self.texts(t): lp for t, lp in pairs}

    def body(self) -> dict[str, Any]:
        if self.chat:
            content = [
                {**_chat_entry(token, lp), "top_logprobs": top}
                for token, lp, top in zip(self.tokens, self.values, self.tops, strict=True)
            ]
            return {"content": content}
        return {
            "tokens": self.tokens,
            "token_logprobs": self.values,
            "top_logprobs": self.tops,
            "text_offset": self.offsets,
        }

    def take(self) -> dict[str, Any]:
        """The body for what was added since the last take (streaming)."""
        body = self.body()
        self.tokens, self.values, self.tops, self.offsets = [], [], [], []
        return body


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: ChoiceLogprobs | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs.body() if logprobs is not None else None,
        "finish_reason": finish_reason,
    }


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: ChoiceLogprobs | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs.body() if logprobs is not None else None,
        "finish_reason": finish_reason,
    }


def completion_chunk_choice(
    index: int, update: ChoiceUpdate, logprobs: ChoiceLogprobs | None
) -> dict[str, Any]:
    if logprobs is not None:
        logprobs.add(update)
    return {
        "index": index,
        "text": update.text,
        "logprobs": logprobs.take() if logprobs is not None else None,
        "finish_reason": update.finish_reason,
    }


def chat_chunk_choice(
    index: int, update: ChoiceUpdate, logprobs: ChoiceLogprobs | None, first: bool
) -> dict[str, Any]:
    if logprobs is not None:
        logprobs.add(update)
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if update.text or first:
        delta["content"] = update.text
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs.take() if logprobs is not None else None,
        "finish_reason": update.finish_reason,
    }
