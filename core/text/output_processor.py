"""Engine token deltas -> user-facing ``RequestOutput``s, for the LLM and the frontends.

The processor owns everything the engine does not: expanding ``n > 1`` into child
requests and gathering them back, incremental detokenization, stop strings, and
logprobs bookkeeping. It runs in the frontend process (or in-process for the offline
``LLM``) and imports no torch.

Request ids: a request with ``n == 1`` goes to the engine under its own id; with
``n > 1`` child ``i`` is ``f"{request_id}/{i}"`` and, when the request has a seed,
is seeded with ``seed + i``. Children share identical prompt ids so the engine
shares their prompt blocks.

Stop strings are matched here: the text is cut right before the match, the child
finishes with ``finish_reason="stop"`` and ``stop_reason`` set to the string, and its
engine id is returned in ``ProcessResult.abort_ids`` for the caller to abort. Deltas
that arrive later for a finished child (such as the abort's own) are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from tokenloom.protocols.outputs import FinishReason, RequestMetrics, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import MAX_SEED, SamplingParams
from tokenloom.text.detokenizer import IncrementalDetokenizer, TokenDecoder
from tokenloom.text.request_output import (
    CompletionOutput,
    RequestOutput,
    TokenLogprobs,
    merge_metrics,
)


@dataclass(slots=True)
class ProcessResult:
    outputs: list[RequestOutput]  # one per request that changed, in first-delta order
    abort_ids: list[str]  # engine request ids to abort: a stop string matched


@dataclass(slots=True)
class _Completion:
    """One engine request's progress (a child of a user request)."""

    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]  # params.stop without empty strings
    stop_token_ids: frozenset[int]  # EOS and params.stop_token_ids: kept out of the text
    completions: dict[str, _Completion]  # by engine request id
    num_unfinished: int
    num_cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None


class OutputProcessor:
    """Tracks the requests of one frontend (or ``LLM``); not thread-safe.

    ``stream=False`` (the offline ``LLM``) reports only finished requests and, for
    requests without stop strings, detokenizes once at the end instead of per token:
    the same text (the detokenizer gives the same result for any grouping of ids) at
    a fraction of the per-step host cost.
    """

    def __init__(self, tokenizer: TokenDecoder, stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self._requests: dict[str, _Request] = {}
        self._parent_of: dict[str, str] = {}  # engine request id -> request id

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        priority: int = 0,
        arrival_time: float = 0.0,
        deadline: float | None = None,
        tenant: str = "",
        metadata: dict[str, str] | None = None,
    ) -> list[GenerateRequest]:
        """Start tracking a request; return the engine requests to submit (n of them).
        Raises ValueError for an id that is still being tracked."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        engine_ids = (
            [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        )
        prompt_ids = list(prompt_token_ids)
        engine_requests: list[GenerateRequest] = []
        completions: dict[str, _Completion] = {}
        for index, engine_id in enumerate(engine_ids):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else (params.seed + index) % MAX_SEED
                child_params = msgspec.structs.replace(params, n=1, seed=seed)
            engine_requests.append(
                GenerateRequest(
                    request_id=engine_id,
                    prompt_token_ids=list(prompt_ids),
                    params=child_params,
                    eos_token_ids=list(eos_token_ids),
                    priority=priority,
                    arrival_time=arrival_time,
                    deadline=deadline,
                    tenant=tenant,
                    metadata=dict(metadata or {}),
                )
            )
            completions[engine_id] = _Completion(
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, params.skip_special_tokens
                ),
                logprobs=None if params.logprobs is None else [],
                cumulative_logprob=None if params.logprobs is None else 0.0,
            )
            self._parent_of[engine_id] = request_id
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._requests[request_id] = _Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            stop=tuple(s for s in params.stop if s),
            stop_token_ids=frozenset(stop_ids),
            completions=completions,
            num_unfinished=params.n,
        )
        return engine_requests

    def abort_request(self, request_id: str) -> list[str]:
        """Stop tracking a request (the client went away); return the engine ids of its
        unfinished completions, to abort in the engine. Unknown ids give []."""
        request = self._forget(request_id)
        if request is None:
            return []
        return [eid for eid, c in request.completions.items() if c.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process(self, deltas: Sequence[TokenDelta]) -> ProcessResult:
        """Fold one engine step's deltas into the requests. Finished requests are
        reported once, then forgotten."""
        changed: dict[str, _Request] = {}
        touched: dict[str, dict[str, _Completion]] = {}  # request id -> changed completions
        abort_ids: list[str] = []
        for delta in deltas:
            request_id = self._parent_of.get(delta.request_id)
            if request_id is None:
                continue
            request = self._requests[request_id]
            completion = request.completions[delta.request_id]
            if completion.finish_reason is not None:
                continue
            if self._apply(request, completion, delta):
                abort_ids.append(delta.request_id)
            touched.setdefault(request_id, {})[delta.request_id] = completion
            request.num_cached_tokens = max(request.num_cached_tokens, delta.num_cached_tokens)
            if delta.prompt_logprobs is not None:
                request.prompt_logprobs = delta.prompt_logprobs
            changed[request_id] = request
        outputs = [
            self._output(request, touched[request.request_id].values())
            for request in changed.values()
            if self.stream or request.num_unfinished == 0
        ]
        for request in changed.values():
            if request.num_unfinished == 0:
                self._forget(request.request_id)
        return ProcessResult(outputs, abort_ids)

    def _forget(self, request_id: str) -> _Request | None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            for engine_id in request.completions:
                self._parent_of.pop(engine_id, None)
        return request

    def _apply(self, request: _Request, completion: _Completion, delta: TokenDelta) -> bool:
        """Append the delta's tokens; returns True when a stop string finished it."""
        stop = request.stop
        new_ids = delta.new_token_ids
        # A final EOS / stop token id stays in token_ids but out of the text.
        stopped_by_id = (
            delta.finish_reason == FinishReason.STOP
            and bool(new_ids)
            and new_ids[-1] in request.stop_token_ids
        )
        num_text_tokens = len(new_ids) - 1 if stopped_by_id else len(new_ids)
        for i, token_id in enumerate(new_ids):
            completion.token_ids.append(token_id)
            if completion.logprobs is not None and delta.logprobs is not None:
                self._append_logprobs(completion, delta, i, token_id)
            if i < num_text_tokens and stop:
                piece = completion.detokenizer.add((token_id,))
                if piece and self._append_text(completion, piece, stop):
                    self._finish(request, completion, FinishReason.STOP)
                    return True
        if not stop and num_text_tokens and self.stream:
            completion.text += completion.detokenizer.add(new_ids[:num_text_tokens])
        if delta.finish_reason is None:
            return False
        completion.metrics = delta.metrics
        if not stop and not self.stream:
            ids = completion.token_ids
            text_ids = ids[: len(ids) - (len(new_ids) - num_text_tokens)]
            completion.text = completion.detokenizer.add(text_ids)
        tail = completion.detokenizer.flush()
        if tail and self._append_text(completion, tail, stop):
            self._finish(request, completion, FinishReason.STOP)
            return True
        if stopped_by_id and new_ids[-1] in request.params.stop_token_ids:
            completion.stop_reason = new_ids[-1]
        self._finish(request, completion, delta.finish_reason)
        return False

    @staticmethod
    def _append_logprobs(completion: _Completion, delta: TokenDelta, i: int, token_id: int) -> None:
        assert completion.logprobs is not None and delta.logprobs is not None
        sampled = delta.logprobs[i]
        entry: TokenLogprobs = {}
        if delta.top_logprobs is not None:
            top = delta.top_logprobs[i]
            entry.update(zip(top.token_ids, top.logprobs, strict=True))
        entry[token_id] = sampled
        completion.logprobs.append(entry)
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sampled

    @staticmethod
    def _append_text(completion: _Completion, piece: str, stop: Sequence[str]) -> bool:
        """Add text; on a stop string, cut the text before it and return True."""
        searched_from = max(0, len(completion.text) - max(map(len, stop), default=1) + 1)
        completion.text += piece
        match_at, match = find_first_stop(completion.text, stop, searched_from)
        if match is None:
            return False
        completion.text = completion.text[:match_at]
        completion.stop_reason = match
        return True

    @staticmethod
    def _finish(request: _Request, completion: _Completion, reason: str) -> None:
        completion.finish_reason = reason
        request.num_unfinished -= 1

    @staticmethod
    def _output(request: _Request, changed: Iterable[_Completion]) -> RequestOutput:
        """The request's output: every completion once it finished, else only the
        ``changed`` ones (in index order), so that a step costs O(changed), not O(n)."""
        holdback = max(map(len, request.stop), default=1) - 1
        if request.num_unfinished == 0:
            completions: Iterable[_Completion] = request.completions.values()
        else:
            completions = sorted(changed, key=lambda c: c.index)
        outputs = []
        for c in completions:
            releasable = len(c.text) if c.finish_reason is not None else len(c.text) - holdback
            releasable = max(releasable, c.num_sent_chars)
            text = c.text if releasable == len(c.text) else c.text[:releasable]
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=c.token_ids,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=c.logprobs,
                    cumulative_logprob=c.cumulative_logprob,
                    text_delta=text[c.num_sent_chars :],
                    token_ids_delta=c.token_ids[c.num_sent_tokens :],
                    logprobs_delta=None if c.logprobs is None else c.logprobs[c.num_sent_tokens :],
                    metrics=c.metrics,
                )
            )
            c.num_sent_chars = releasable
            c.num_sent_tokens = len(c.token_ids)
        finished = request.num_unfinished == 0
        metrics = None
        if finished:
            parts = [c.metrics for c in request.completions.values() if c.metrics is not None]
            metrics = merge_metrics(parts)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
            metrics=metrics,
        )


def find_first_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str | None]:
    """The earliest occurrence in ``text[start:]`` of any of ``stop`` (the first listed
    wins a tie): ``(position, string)``, or ``(-1, None)``."""
    best_at, best = -1, None
    for candidate in stop:
        at = text.find(candidate, start)
        if at != -1 and (best is None or at < best_at):
            best_at, best = at, candidate
    return best_at, best
