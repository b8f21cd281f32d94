"""The prompts of an OpenAI request: decoding its body, counting its prompts, and
tokenizing text and chat messages (in a way that lets a worker thread release the GIL
for a large input)."""

from __future__ import annotations

from typing import Any

from tokenloom.plugins.frontends.openai.body import check_json_depth
from tokenloom.plugins.frontends.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_chat,
    decode_completion,
)

OFFLOAD_BYTES = 64 * 1024  # inputs larger than this are decoded and tokenized off the loop


def decode_body(body: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    check_json_depth(body)
    return decode_chat(body) if chat else decode_completion(body)


def num_prompts(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def encode_all(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of ``texts``, through the ``tokenizers`` backend's ``encode_batch``
    where there is one: unlike ``encode``, it releases the GIL, so a worker thread
    tokenizing a large prompt does not stall the event loop (a 512 KiB prompt held
    it for 0.3-0.4 s)."""
    backend = getattr(tokenizer, "_backend", None)  # core.tokenizer.Tokenizer's
    if len(texts) == 1 and sum(map(len, texts)) <= OFFLOAD_BYTES or backend is None:
        return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]
    encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    return [encoding.ids for encoding in encodings]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:  # ChatTemplateError: the template refused them
        raise RequestError(f"messages: {exc}", "messages") from exc
    return encode_all(tokenizer, [text], add_special_tokens=False)[0]
