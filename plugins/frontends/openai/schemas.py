"""OpenAI request bodies as msgspec Structs, and their translation to SamplingParams.

Unknown fields are ignored (msgspec's default); a wrong type or an out-of-range
value raises ``RequestError`` naming the field, answered as HTTP 400. OpenAI fields
this server does not implement are declared so that a request using them is refused
by name (``UNSUPPORTED``), not silently served without them: ``logit_bias``,
``best_of`` > 1, ``suffix``, ``echo``, ``tools``/``functions`` and a ``tool_choice``
other than "none", a ``response_format`` other than text, and non-text content parts.

Extras beyond OpenAI's fields include ``num_speculative_tokens`` (speculative decoding:
the drafts verified per step for this request, 0 to turn it off, at most the server's).

``request_params`` builds a request's SamplingParams and runs the shared
``check_request_limits`` before any tokenization; ``sampling_params`` then fits
``max_tokens`` to each prompt's length.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.plugins.frontends.limits import ModelLimits, PromptError, check_request_limits
from tokenloom.protocols.jobs import Metadata
from tokenloom.protocols.sampling import InvalidParameter, SamplingParams

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


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


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
    user: str | None = None  # the engine request's tenant
    metadata: Metadata | None = None  # passed to the scheduler with the request
    # extras
    include_metrics: bool = False  # the response carries "metrics" (RequestMetrics as seconds)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    priority: int = 0
    # drafts verified per step for this request (speculative decoding); None: the
    # server's num_speculative_tokens, 0: off; at most the server's
    num_speculative_tokens: int | None = None
    # OpenAI fields that are not implemented: refused unless left at their no-op value
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]  # images and audio are refused by name
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart]
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
    if request.suffix:
        raise RequestError("suffix: is not supported", "suffix")
    _refuse_unsupported(request)
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
    _refuse_unsupported(request)
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    return request


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def request_params(
    request: CompletionRequest | ChatCompletionRequest, config: EngineConfig, num_prompts: int = 1
) -> SamplingParams:
    """The request's SamplingParams with ``max_tokens`` as asked, checked against the
    config's limits and the engine's ranges (``check_request_limits``); cheap, so it
    runs before admission and tokenization."""
    _check_speculative(request.num_speculative_tokens, config)
    max_tokens, max_field = _max_tokens(request)
    logprobs: int | None
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        params = SamplingParams(
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
            num_speculative_tokens=request.num_speculative_tokens,
        )
        check_request_limits(config, params, num_prompts=num_prompts, priority=request.priority)
    except InvalidParameter as exc:
        raise _field_error(request, exc.field, str(exc), max_field) from exc
    except PromptError as exc:
        raise _field_error(request, exc.field, str(exc), max_field) from exc
    return params


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    limits: ModelLimits,
    config: EngineConfig | None = None,
    base: SamplingParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams for one prompt of ``num_prompt_tokens``: ``base``
    (else ``request_params``) with ``max_tokens`` fitted to the model length; rejects a
    prompt that cannot fit. With no max_tokens the output may use the rest of it."""
    if base is None:
        base = request_params(request, config or EngineConfig())
    max_tokens, max_field = _max_tokens(request)
    try:
        room = limits.output_room(num_prompt_tokens, max_tokens, max_field)
    except PromptError as exc:
        raise RequestError(str(exc), exc.field) from exc
    if room == base.max_tokens:
        return base
    if base.min_tokens > room:
        raise RequestError(f"min_tokens: must be <= {room}, the room left", "min_tokens")
    return msgspec.structs.replace(base, max_tokens=room)


def _check_speculative(value: int | None, config: EngineConfig) -> None:
    """A request's ``num_speculative_tokens`` is in ``[0, server's]`` (only 0 when the
    server does not speculate): refused by name rather than silently capped."""
    top = config.num_speculative_tokens
    if value is not None and not 0 <= value <= top:
        raise RequestError(
            f"num_speculative_tokens: must be in [0, {top}] (this server's num_speculative_tokens)",
            "num_speculative_tokens",
        )


def _max_tokens(request: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str]:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def _field_error(
    request: CompletionRequest | ChatCompletionRequest, field: str, message: str, max_field: str
) -> RequestError:
    """A SamplingParams field's error under the name the HTTP request gave it."""
    name = max_field if field == "max_tokens" else field
    if isinstance(request, ChatCompletionRequest) and field == "logprobs":
        name = "top_logprobs"
    if isinstance(request, ChatCompletionRequest) and field == "prompt":
        name = "messages"
    return RequestError(message.replace(field, name, 1), name)


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, by name, an OpenAI field this server would otherwise ignore."""
    for field, ok in (
        ("logit_bias", not request.logit_bias),
        ("best_of", request.best_of is None or request.best_of <= 1),
        ("tools", not request.tools),
        ("functions", not request.functions),
        ("tool_choice", request.tool_choice in (None, "none", "auto")),
        ("function_call", request.function_call in (None, "none", "auto")),
        ("response_format", request.response_format is None
         or request.response_format.type == "text"),
    ):  # fmt: skip
        if not ok:
            raise RequestError(f"{field}: is not supported by this server", field)


def _decode(decoder: msgspec.json.Decoder, body: bytes):  # type: ignore[no-untyped-def]
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_FIELD.search(text)
        param = match.group(1) if match else None
        if "missing required field" in text and text.count("`") >= 2:
            missing = text.split("`", 2)[1]
            param = f"{param}.{missing}" if param else missing
        raise RequestError(f"{param}: {_AT_FIELD.sub('', text)}" if param else text, param) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"body: not valid JSON: {exc}", "body") from exc
    except RecursionError as exc:  # a backstop: read_json_body limits the depth first
        raise RequestError("body: JSON nested too deeply", "body") from exc
