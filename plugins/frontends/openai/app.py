"""The OpenAI-compatible HTTP routes: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /version.

Each generation request is decoded into a Struct, tokenized, checked against the
model length, then run as one ``Generation`` per prompt. Errors before the first
output become HTTP statuses (400 invalid, 401 key, 404 model, 503 overloaded or
engine down, with Retry-After); errors after a stream started become an SSE
``error`` event. A client that disconnects aborts its request at once.

With ``config.request_timeout_s`` set, a request still running after that long is
aborted in the engine and answered normally with what it generated so far, its
open choices finishing with ``finish_reason: "timeout"``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tokenloom
from tokenloom.engine_client import EngineDeadError, EngineError
from tokenloom.plugins.frontends.generation import ChoiceUpdate, Generation
from tokenloom.plugins.frontends.limits import PromptError
from tokenloom.plugins.frontends.openai import formatting as fmt
from tokenloom.plugins.frontends.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_chat,
    decode_completion,
    message_text,
    sampling_params,
)
from tokenloom.plugins.frontends.openai.streaming import (
    DONE,
    EventStreamResponse,
    sse_event,
    unless_disconnected,
)

if TYPE_CHECKING:
    from tokenloom.plugins.frontends.openai.frontend import OpenAIFrontend

Merged = AsyncGenerator[tuple[int, list[ChoiceUpdate]], None]  # (prompt index, updates)
_encode = msgspec.json.Encoder().encode
CLIENT_CLOSED = 499  # nginx's status for "client closed request"; nobody reads it


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(body), status, headers, media_type="application/json")


def error_response(error: RequestError) -> Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return json_response(error.body(), error.status, headers)


def engine_error(exc: BaseException) -> RequestError:
    if isinstance(exc, EngineDeadError):
        return RequestError("the engine is not running", None, 503, "service_unavailable")
    code = int(getattr(exc, "code", 500))
    message = str(getattr(exc, "message", exc))
    kind = "service_unavailable" if code == 503 else None
    return RequestError(message, None, code if 400 <= code < 600 else 500, kind)


class OpenAIApp:
    """Route handlers; state (engine, tokenizer, metrics) lives on the frontend."""

    def __init__(self, frontend: OpenAIFrontend) -> None:
        self.frontend = frontend
        self.texts = fmt.TokenTexts(frontend.tokenizer)
        self.created = int(time.time())
        self.starlette = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
            ]
        )

    # ------------------------------------------------------------------ info routes

    async def models(self, request: Request) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        card = {
            "id": self.frontend.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tokenloom",
            "root": self.frontend.config.model,
            "parent": None,
            "max_model_len": self.frontend.limits.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.frontend.engine.is_alive:
            return json_response({"status": "ok"})
        return json_response({"status": "engine dead"}, 503)

    async def metrics(self, request: Request) -> Response:
        engine = self.frontend.engine
        stats = None
        if engine.is_alive:
            try:
                stats = await asyncio.wait_for(engine.stats(), 2.0)
            except (TimeoutError, EngineError, EngineDeadError):
                stats = None
        text = self.frontend.metrics.render(stats, engine.is_alive)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def version(self, request: Request) -> Response:
        return json_response({"version": tokenloom.__version__})

    # ------------------------------------------------------------------ generation routes

    async def completions(self, request: Request) -> Response:
        try:
            if (denied := self._authorize(request)) is not None:
                return denied
            req = decode_completion(await request.body())
            self._check_model(req.model)
            prompts = self._completion_prompts(req)
            return await self._generate(request, req, prompts, chat=False)
        except RequestError as exc:
            return error_response(exc)

    async def chat_completions(self, request: Request) -> Response:
        try:
            if (denied := self._authorize(request)) is not None:
                return denied
            req = decode_chat(await request.body())
            self._check_model(req.model)
            messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
            tokenizer = self.frontend.tokenizer
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except ValueError as exc:  # ChatTemplateError: the template refused them
                raise RequestError(f"messages: {exc}", "messages") from exc
            ids = tokenizer.encode(text, add_special_tokens=False)
            return await self._generate(request, req, [(None, ids)], chat=True)
        except RequestError as exc:
            return error_response(exc)

    async def _generate(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        chat: bool,
    ) -> Response:
        frontend = self.frontend
        if not frontend.engine.is_alive:
            raise engine_error(EngineDeadError())
        params = [sampling_params(req, len(ids), frontend.limits) for _, ids in prompts]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generations = [
            frontend.live.new(f"{request_id}-{i}", text, ids, sp, req.priority)
            for i, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True))
        ]
        merged = _merge(generations)
        try:
            first = await unless_disconnected(anext(merged, None), request.receive)
        except (EngineError, EngineDeadError) as exc:
            await _close_all(merged, generations)
            raise engine_error(exc) from exc
        if first is None:
            await _close_all(merged, generations)
            return Response(status_code=CLIENT_CLOSED)
        stream = _chain(first, merged)
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
        make_choice = fmt.chat_choice if chat else fmt.completion_choice
        choices = [
            make_choice(i, "".join(parts), finish[i], logprobs[i] if logprobs else None)
            for i, parts in enumerate(texts)
        ]
        return {**head, "choices": choices, "usage": _usage(generations)}

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
                yield sse_event({**head, "choices": [], "usage": _usage(generations)})
        except (EngineError, EngineDeadError) as exc:
            yield sse_event(engine_error(exc).body())
        finally:
            await stream.aclose()
        yield DONE

    # ------------------------------------------------------------------ helpers

    def _authorize(self, request: Request) -> Response | None:
        key = self.frontend.config.api_key
        if not key:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        error = RequestError("invalid or missing API key", None, 401, "authentication_error")
        return json_response(error.body(), 401, {"WWW-Authenticate": "Bearer"})

    def _check_model(self, model: str | None) -> None:
        served = (self.frontend.model_name, self.frontend.config.model)
        if model is not None and model not in served and Path(model).name not in served:
            raise RequestError(f"model: {model!r} is not served here", "model", 404)

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        encode = self.frontend.tokenizer.encode
        prompt = req.prompt
        if isinstance(prompt, str):
            return [(prompt, encode(prompt))]
        if isinstance(prompt[0], str):
            return [(p, encode(p)) for p in prompt]  # type: ignore[arg-type]
        id_lists = [prompt] if isinstance(prompt[0], int) else prompt
        for ids in id_lists:
            try:
                self.frontend.limits.check_token_ids(ids)  # type: ignore[arg-type]
            except PromptError as exc:
                raise RequestError(str(exc), exc.field) from exc
        return [(None, list(ids)) for ids in id_lists]  # type: ignore[arg-type]

    def _logprobs(self, count: int, req: Any, chat: bool) -> list[fmt.ChoiceLogprobs] | None:
        wanted = req.logprobs if chat else req.logprobs is not None
        if not wanted:
            return None
        return [fmt.ChoiceLogprobs(chat, self.texts) for _ in range(count)]


def _usage(generations: list[Generation]) -> dict[str, Any]:
    return fmt.usage(
        sum(g.num_prompt_tokens for g in generations),
        sum(g.num_generated_tokens for g in generations),
        sum(g.num_cached_tokens for g in generations),
    )


async def _close_all(merged: Merged, generations: list[Generation]) -> None:
    await merged.aclose()
    for generation in generations:  # also those whose updates() never started
        await generation.close()


async def _chain(first: tuple[int, list[ChoiceUpdate]], rest: Merged) -> Merged:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _merge(generations: list[Generation]) -> Merged:
    """The updates of every generation, tagged with its index, as they come."""
    if len(generations) == 1:
        updates = generations[0].updates()
        try:
            async for batch in updates:
                yield 0, batch
        finally:
            await updates.aclose()
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for batch in generation.updates():
                queue.put_nowait((index, batch))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item[1] is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
