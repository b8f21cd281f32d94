"""The OpenAI-compatible HTTP routes: /v1/completions, /v1/chat/completions, and the
cheap routes of ``info`` (/v1/models, /health, /metrics, /version, /openapi.json).

A generation request goes through, in order, each step refusing with a 4xx/503 that
names the field before the next costs anything: the API key; the body
(``read_json_body``: 415 media type, 413 size, 400 nesting); decoding into a Struct;
the model name; the engine being alive; ``request_params`` (the shared limits);
admission of its ``n`` x prompts sequences (503 + Retry-After at once when they do not
fit); tokenization; the model length. Decoding and tokenizing an input larger than
``OFFLOAD_BYTES`` run in a worker thread, so a huge body never stalls the event loop
(and /health). Then one ``Generation`` per prompt runs. Errors after a stream started
become an SSE ``error`` event. A client that disconnects aborts its request at once.

With ``config.request_timeout_s`` set, a request still running after that long is
aborted in the engine and answered normally with what it generated so far, its
open choices finishing with ``finish_reason: "timeout"``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tokenloom.plugins.frontends.admission import Reservation
from tokenloom.plugins.frontends.generation import Generation
from tokenloom.plugins.frontends.limits import PromptError
from tokenloom.plugins.frontends.openai import formatting as fmt
from tokenloom.plugins.frontends.openai.body import read_json_body
from tokenloom.plugins.frontends.openai.choices import (
    Merged,
    chain,
    close_all,
    engine_metrics,
    merge,
    usage,
)
from tokenloom.plugins.frontends.openai.fast_lane import (
    FAST_RATE,
    SLOW_RATE,
    Meter,
    Pacer,
    fast_lane_protocol,
)
from tokenloom.plugins.frontends.openai.info import (
    InfoRoutes,
    _encode,
    json_response,
    key_matches,
    unauthorized,
)
from tokenloom.plugins.frontends.openai.prompts import (
    OFFLOAD_BYTES,
    chat_ids,
    decode_body,
    encode_all,
    num_prompts,
)
from tokenloom.plugins.frontends.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    message_text,
    request_params,
    sampling_params,
)
from tokenloom.plugins.frontends.openai.state import ServerState
from tokenloom.plugins.frontends.openai.streaming import (
    DONE,
    EventStreamResponse,
    sse_event,
    unless_disconnected,
)
from tokenloom.protocols.components.errors import EngineDeadError, EngineError, QueueFullError
from tokenloom.protocols.sampling import SamplingParams

T = TypeVar("T")
Prompts = list[tuple[str | None, list[int]]]
CLIENT_CLOSED = 499  # nginx's status for "client closed request"; nobody reads it
MAX_ECHOED_CHARS = 100  # of a client's string quoted back in an error


def error_response(error: RequestError) -> Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return json_response(error.body(), error.status, headers)


def engine_error(exc: BaseException) -> RequestError:
    if isinstance(exc, EngineDeadError):
        return RequestError("the engine is not running", None, 503, "service_unavailable")
    if isinstance(exc, QueueFullError):
        return RequestError(f"queue full: {exc}", None, 503, "service_unavailable")
    code = int(getattr(exc, "code", 500))
    message = str(getattr(exc, "message", exc))
    kind = "service_unavailable" if code == 503 else None
    return RequestError(message, None, code if 400 <= code < 600 else 500, kind)


class OpenAIApp:
    """Route handlers; state (engine, tokenizer, metrics) lives on the frontend."""

    def __init__(self, frontend: ServerState) -> None:
        self.frontend = frontend
        self.texts = fmt.TokenTexts(frontend.tokenizer)
        self.max_body_bytes = int(frontend.config.max_request_body_mb * 1024 * 1024)
        # few workers: a flood of huge prompts queues here instead of taking all memory
        self.workers = ThreadPoolExecutor(2, thread_name_prefix="tokenloom-openai")
        info = InfoRoutes(frontend)
        # uvicorn's protocol with /health answered before any parsing and the parsing
        # of other requests metered, so that no burst delays /health (fast_lane.py)
        self.meter = Meter()
        info.pacer = Pacer(SLOW_RATE, 2 * SLOW_RATE)
        refusals = {"/v1/completions": self._refusal, "/v1/chat/completions": self._refusal}
        self.http_protocol = fast_lane_protocol(
            AutoHTTPProtocol, info.fast_answers(), self.meter, Pacer(FAST_RATE), refusals
        )
        self.starlette = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", info.models, methods=["GET"]),
                Route("/health", info.health, methods=["GET"]),
                Route("/metrics", info.metrics, methods=["GET"]),
                Route("/version", info.version, methods=["GET"]),
                Route("/openapi.json", info.openapi, methods=["GET"]),
            ]
        )

    def _refusal(self, authorization: bytes | None) -> bytes | None:
        """The 503 body for a generation request while the queue has no room for even
        one sequence, if the request carries the key (else None: the route answers,
        with its 401); for the fast lane, which has read nothing else of it."""
        frontend = self.frontend
        admission = frontend.admission
        if admission.can_admit(1) or not frontend.engine.is_alive:
            return None
        if not key_matches(frontend.config.api_key, authorization):
            return None
        frontend.metrics.record_refused(503)
        message = f"queue full: {admission.in_flight} sequences in flight, no room for more"
        return _encode(RequestError(message, None, 503, "service_unavailable").body())

    # ------------------------------------------------------------------ generation routes

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        frontend = self.frontend
        reservation: Reservation | None = None
        try:
            if (denied := unauthorized(frontend.config.api_key, request)) is not None:
                frontend.metrics.record_refused(401)
                return denied
            body = await read_json_body(request, self.max_body_bytes)
            req = await self._off_loop(len(body), decode_body, body, chat)
            self._check_model(req.model)
            if not frontend.engine.is_alive:
                raise engine_error(EngineDeadError())
            count = 1 if chat else num_prompts(req.prompt)
            base = request_params(req, frontend.config, count)
            try:
                reservation = frontend.live.reserve(base.n * count)
            except QueueFullError as exc:
                raise engine_error(exc) from exc
            if chat:
                prompts = await self._chat_prompt(req)
            else:
                prompts = await self._completion_prompts(req)
            return await self._generate(request, req, prompts, base, reservation, chat)
        except RequestError as exc:
            frontend.metrics.record_refused(exc.status)
            return error_response(exc)
        finally:
            if reservation is not None:
                reservation.release()  # what no generation took (all of it on an error)

    async def _off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, in a worker thread when the input is over ``OFFLOAD_BYTES``."""
        if size <= OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    async def _generate(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: Prompts,
        base: SamplingParams,
        reservation: Reservation | None,
        chat: bool,
    ) -> Response:
        frontend = self.frontend
        limits, config = frontend.limits, frontend.config
        params = [sampling_params(req, len(ids), limits, config, base) for _, ids in prompts]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generations = [
            frontend.live.new(
                f"{request_id}-{i}", text, ids, sp, req.priority,
                reservation.split(sp.n) if reservation is not None else None,
                tenant=req.user or "", metadata=req.metadata,
            )
            for i, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True))
        ]  # fmt: skip
        merged = merge(generations)
        try:
            first = await unless_disconnected(anext(merged, None), request.receive)
        except (EngineError, EngineDeadError) as exc:
            await close_all(merged, generations)
            raise engine_error(exc) from exc
        if first is None:
            await close_all(merged, generations)
            return Response(status_code=CLIENT_CLOSED)
        stream = chain(first, merged)
        head = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": frontend.model_name,
        }
        if req.stream:
            events = self._events(stream, generations, req, head, chat)
            return EventStreamResponse(events)
        body = await unless_disconnected(
            self._collect(stream, generations, req, head, chat), request.receive
        )
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        return json_response(body)

    async def _collect(
        self,
        stream: Merged,
        generations: list[Generation],
        req: Any,
        head: dict[str, Any],
        chat: bool,
    ) -> dict[str, Any]:
        n = req.n
        texts: list[list[str]] = [[] for _ in range(n * len(generations))]
        finish: list[str | None] = [None] * len(texts)
        logprobs = self._logprobs(len(texts), req, chat)
        try:
            async for prompt_index, updates in stream:
                for update in updates:
                    index = prompt_index * n + update.index
                    texts[index].append(update.text)
                    finish[index] = update.finish_reason or finish[index]
                    if logprobs is not None:
                        logprobs[index].add(update)
        except (EngineError, EngineDeadError) as exc:
            raise engine_error(exc) from exc
        finally:
            await stream.aclose()
        await self.meter.turn()  # many requests finishing in one step: spread over iterations
        make_choice = fmt.chat_choice if chat else fmt.completion_choice
        choices = [
            make_choice(i, "".join(parts), finish[i], logprobs[i] if logprobs else None)
            for i, parts in enumerate(texts)
        ]
        body = {**head, "choices": choices, "usage": usage(generations)}
        if req.include_metrics:
            body["metrics"] = engine_metrics(generations)
        return body

    async def _events(
        self,
        stream: Merged,
        generations: list[Generation],
        req: Any,
        head: dict[str, Any],
        chat: bool,
    ) -> AsyncIterator[bytes]:
        n = req.n
        head = {**head, "object": "chat.completion.chunk"} if chat else head
        logprobs = self._logprobs(n * len(generations), req, chat)
        started: set[int] = set()
        try:
            async for prompt_index, updates in stream:
                choices = []
                for update in updates:
                    if not (update.text or update.finish_reason or logprobs is not None):
                        continue  # tokens whose text is held back (partial UTF-8, stop string)
                    index = prompt_index * n + update.index
                    lp = logprobs[index] if logprobs is not None else None
                    if chat:
                        first = index not in started
                        started.add(index)
                        choices.append(fmt.chat_chunk_choice(index, update, lp, first))
                    else:
                        choices.append(fmt.completion_chunk_choice(index, update, lp))
                if choices:
                    yield sse_event({**head, "choices": choices})
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse_event({**head, "choices": [], "usage": usage(generations)})
            if req.include_metrics:
                yield sse_event({**head, "choices": [], "metrics": engine_metrics(generations)})
        except (EngineError, EngineDeadError) as exc:
            yield sse_event(engine_error(exc).body())
        finally:
            await stream.aclose()
        yield DONE

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str | None) -> None:
        served = (self.frontend.model_name, self.frontend.config.model)
        if model is not None and model not in served and Path(model).name not in served:
            shown = model if len(model) <= MAX_ECHOED_CHARS else model[:MAX_ECHOED_CHARS] + "..."
            raise RequestError(f"model: {shown!r} is not served here", "model", 404)

    async def _completion_prompts(self, req: CompletionRequest) -> Prompts:
        prompt = req.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts: list[str] = [prompt] if isinstance(prompt, str) else prompt  # type: ignore[list-item]
            size = sum(len(text) for text in texts)
            self._check_text_length(max(len(text) for text in texts), "prompt")
            ids = await self._off_loop(size, encode_all, self.frontend.tokenizer, texts)
            return list(zip(texts, ids, strict=True))
        id_lists = [prompt] if isinstance(prompt[0], int) else prompt
        for ids in id_lists:
            try:
                self.frontend.limits.check_token_ids(ids)  # type: ignore[arg-type]
            except PromptError as exc:
                raise RequestError(str(exc), exc.field) from exc
        return [(None, list(ids)) for ids in id_lists]  # type: ignore[arg-type]

    def _check_text_length(self, num_chars: int, field: str) -> None:
        try:
            self.frontend.limits.check_text_length(num_chars, field)
        except PromptError as exc:
            raise RequestError(str(exc), exc.field) from exc

    async def _chat_prompt(self, req: ChatCompletionRequest) -> Prompts:
        messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
        size = sum(len(m["content"]) for m in messages)
        self._check_text_length(size, "messages")
        ids = await self._off_loop(size, chat_ids, self.frontend.tokenizer, messages)
        return [(None, ids)]

    def _logprobs(self, count: int, req: Any, chat: bool) -> list[fmt.ChoiceLogprobs] | None:
        wanted = req.logprobs if chat else req.logprobs is not None
        if not wanted:
            return None
        return [fmt.ChoiceLogprobs(chat, self.texts) for _ in range(count)]
