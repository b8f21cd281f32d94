"""OpenAI request bodies as msgspec Structs, and their translation to SamplingParams.

Unknown fields are ignored (msgspec's default); a wrong type or an out-of-range
value raises ``RequestError`` naming the field, answered as HTTP 400.
"""

from __future__ import annotations

import re

import msgspec

from tokenloom.plugins.frontends.limits import ModelLimits, PromptError
from tokenloom.protocols.sampling import InvalidParameter, SamplingParams

MAX_N = 128
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(ValueError):
    """A request is invalid; answered with ``status`` and an OpenAI error body."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI's and the extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    priority: int = 0


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_AT_FIELD = re.compile(r" - at `\$\.?([^`]*)`")


def decode_completion(body: bytes) -> CompletionRequest:
    request = _decode(_COMPLETION_DECODER, body)
    if isinstance(request.prompt, list):
        if not request.prompt:
            raise RequestError("prompt: must not be empty", "prompt")
        kinds = {type(item) for item in request.prompt}
        if len(kinds) > 1:
            raise RequestError("prompt: mixes strings, token ids and token-id lists", "prompt")
        if kinds == {list} and any(not item for item in request.prompt):  # type: ignore[union-attr]
            raise RequestError("prompt: a token-id list must not be empty", "prompt")
    if request.echo:
        raise RequestError("echo: is not supported", "echo")
    return request


def decode_chat(body: bytes) -> ChatCompletionRequest:
    request = _decode(_CHAT_DECODER, body)
    if not request.messages:
        raise RequestError("messages: must not be empty", "messages")
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}",
                f"messages[{i}].role",
            )
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    return request


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content if part.type == "text")


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int, limits: ModelLimits
) -> SamplingParams:
    """The request's SamplingParams; rejects a prompt that cannot fit the model length.

    With no max_tokens the output may use the rest of the model length.
    """
    if not 1 <= request.n <= MAX_N:
        raise RequestError(f"n: must be in [1, {MAX_N}]", "n")
    max_tokens, max_field = request.max_tokens, "max_tokens"
    logprobs: int | None
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            max_tokens, max_field = request.max_completion_tokens, "max_completion_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    try:
        max_tokens = limits.output_room(num_prompt_tokens, max_tokens, max_field)
    except PromptError as exc:
        raise RequestError(str(exc), exc.field) from exc
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
        )
    except InvalidParameter as exc:
        field = max_field if exc.field == "max_tokens" else exc.field
        if isinstance(request, ChatCompletionRequest) and exc.field == "logprobs":
            field = "top_logprobs"
        raise RequestError(str(exc).replace(exc.field, field, 1), field) from exc


def _decode(decoder: msgspec.json.Decoder, body: bytes):  # type: ignore[no-untyped-def]
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_FIELD.search(text)
        param = match.group(1) if match else None
        if param is None and "missing required field" in text:
            param = text.rsplit("`", 2)[-2] if text.count("`") >= 2 else None
        raise RequestError(f"{param}: {_AT_FIELD.sub('', text)}" if param else text, param) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from exc
