"""A deterministic fake engine behind the real serving stack, and a server-in-a-thread.

``FakeEngine`` is an ``EngineCore`` (add_request, abort, step, stats,
ready_info, ...) and runs in a real engine-core process started by the real
Supervisor, so the frontends, engine client, sockets and supervision are the real
ones. Tokens are a pure function of the prompt, the output so far and (when
sampling) the seed, so greedy runs are reproducible; KV blocks are accounted like a
paged cache, so /metrics shows them freed. Each request's last delta carries its
``RequestMetrics`` (times on ``time.monotonic``, as the real engine's). Options come from ``[plugin.fake]``:
``step_s`` (seconds per step). That table belongs to this module, registered as the
plugin ``fake`` by ``fake_plugins()`` (which ``ServerThread`` passes to ``serve.run``),
so the config check knows it; its keys are checked by ``FakeSettings``.

Module-level so that the spawned engine-core can import the factory by reference.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from tokenloom.config import plugin_settings
from tokenloom.plugin_manager import PluginManager
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.control import Ready
from tokenloom.protocols.outputs import (
    EngineStats,
    FinishReason,
    RequestMetrics,
    TokenDelta,
    TopLogprobs,
)
from tokenloom.protocols.requests import GenerateRequest

FIRST_TOKEN = 20  # the tiny tokenizers' special tokens sit below this


class FakeSettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.fake]``: seconds per engine step; a file the engine appends one JSON
    line to per added request (its id, priority, tenant and metadata), "" for none."""

    step_s: float = 0.002
    requests_log: str = ""


def fake_plugins() -> PluginManager:
    """The default plugins plus this module as the plugin ``fake`` (the owner of the
    ``[plugin.fake]`` table)."""
    import sys

    plugins = PluginManager.default()
    plugins.register(sys.modules[__name__], "fake", "tests (serving_fakes)")
    return plugins


class _Seq:
    __slots__ = ("req", "output", "blocks", "rng", "metrics")

    def __init__(self, req: GenerateRequest) -> None:
        self.req = req
        self.output: list[int] = []
        self.blocks = 0
        self.metrics = RequestMetrics(arrival_time=req.arrival_time or time.monotonic())
        seed = req.params.seed if req.params.seed is not None else random.getrandbits(32)
        self.rng = random.Random(seed)


class FakeEngine:
    def __init__(self, config: Any) -> None:
        model_config = json.loads((Path(config.model) / "config.json").read_text())
        tokenizer = json.loads((Path(config.model) / "tokenizer.json").read_text())
        self.vocab = len(tokenizer["model"]["vocab"])
        self.model_vocab = int(model_config.get("vocab_size", self.vocab))  # padded: larger
        self.max_model_len = config.max_model_len or model_config["max_position_embeddings"]
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or 256
        self.free_blocks = self.num_blocks
        self.max_running = config.max_num_seqs
        self.max_waiting = config.max_waiting_requests
        settings = plugin_settings(config, "fake", FakeSettings)
        self.step_s = settings.step_s
        self.requests_log = settings.requests_log
        eos = model_config["eos_token_id"]
        self.eos = eos if isinstance(eos, list) else [eos]
        self.waiting: deque[_Seq] = deque()
        self.running: dict[str, _Seq] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0

    def add_request(self, req: GenerateRequest) -> None:
        if len(req.prompt_token_ids) >= self.max_model_len:
            raise ValueError("prompt longer than the model length")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests waiting")
        self.waiting.append(_Seq(req))
        if self.requests_log:
            line = {"request_id": req.request_id, "priority": req.priority}
            line.update(tenant=req.tenant, metadata=req.metadata)
            with open(self.requests_log, "a") as log:
                log.write(json.dumps(line) + "\n")

    def abort(self, request_ids: Sequence[str]) -> list[TokenDelta]:
        ids = set(request_ids)
        deltas = [_last(s, FinishReason.ABORT) for s in self.waiting if s.req.request_id in ids]
        self.waiting = deque(s for s in self.waiting if s.req.request_id not in ids)
        for rid in ids:
            seq = self.running.pop(rid, None)
            if seq is not None:
                self.free_blocks += seq.blocks
                deltas.append(_last(seq, FinishReason.ABORT))
        return deltas

    def step(self) -> list[TokenDelta]:
        time.sleep(self.step_s)
        self.num_steps += 1
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.metrics.first_scheduled_time = time.monotonic()
            self.running[seq.req.request_id] = seq
            self.prompt_tokens += len(seq.req.prompt_token_ids)
        deltas = []
        for rid, seq in list(self.running.items()):
            token = self._next_token(seq)
            seq.output.append(token)
            self.generation_tokens += 1
            needed = -(-(len(seq.req.prompt_token_ids) + len(seq.output)) // self.block_size)
            self.free_blocks -= needed - seq.blocks
            seq.blocks = needed
            delta = TokenDelta(rid, [token], self._finish(seq, token))
            if len(seq.output) == 1:
                delta.num_prompt_tokens = len(seq.req.prompt_token_ids)
            if seq.req.params.logprobs is not None:
                k = seq.req.params.logprobs
                delta.logprobs = [-0.25 * (1 + token % 4)]
                delta.top_logprobs = [
                    TopLogprobs([token + i for i in range(k)], [-0.25 * (1 + i) for i in range(k)])
                ]
            if len(seq.output) == 1:
                seq.metrics.first_token_time = time.monotonic()
            if delta.finish_reason is not None:
                del self.running[rid]
                self.free_blocks += seq.blocks
                seq.metrics.finished_time = time.monotonic()
                delta.metrics = seq.metrics
            deltas.append(delta)
        return deltas

    def _next_token(self, seq: _Seq) -> int:
        history = seq.req.prompt_token_ids + seq.output
        base = (sum(history[-3:]) * 31 + len(history) * 7) % (self.vocab - FIRST_TOKEN)
        if seq.req.params.temperature > 0:
            base = (base + seq.rng.randrange(self.vocab)) % (self.vocab - FIRST_TOKEN)
        return FIRST_TOKEN + base

    def _finish(self, seq: _Seq, token: int) -> str | None:
        params = seq.req.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        limit = min(
            params.max_tokens or self.max_model_len,
            self.max_model_len - len(seq.req.prompt_token_ids),
        )
        return FinishReason.LENGTH if len(seq.output) >= limit else None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_blocks_total=self.num_blocks,
            num_blocks_free=self.free_blocks,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            num_steps=self.num_steps,
        )

    def ready_info(self) -> Ready:
        return Ready(
            pid=os.getpid(),
            model_name="fake",
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_running,
            eos_token_ids=self.eos,
            vocab_size=self.model_vocab,
        )

    def shutdown(self) -> None:
        pass


def _last(seq: _Seq, reason: str) -> TokenDelta:
    """The request's last delta: its finish reason and its metrics."""
    seq.metrics.finished_time = time.monotonic()
    return TokenDelta(seq.req.request_id, [], reason, metrics=seq.metrics)


def make_fake_engine(config: Any, plugin_manager: Any) -> FakeEngine:
    return FakeEngine(config)


class ServerThread:
    """``tokenloom.entrypoints.serve.run`` in a background thread with its own event loop.

    ``start()`` returns once every frontend listens; ``base_url`` and
    ``zmq_endpoint`` are then set. ``stop()`` stops it gracefully and joins.
    """

    def __init__(self, config: Any, engine_factory: Any = make_fake_engine) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.handle: Any = None
        self.exit_code: int | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)

    def _main(self) -> None:
        import asyncio

        from tokenloom.entrypoints.serve import run

        def on_started(handle: Any) -> None:
            self.handle = handle
            self._started.set()

        try:
            self.exit_code = asyncio.run(
                run(
                    self.config,
                    engine_factory=self.engine_factory,
                    on_started=on_started,
                    plugins=fake_plugins(),
                )
            )
        finally:
            self._started.set()

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        if not self._started.wait(timeout_s) or self.handle is None:
            raise RuntimeError(f"server did not start (exit code {self.exit_code})")
        deadline = time.monotonic() + timeout_s
        while not self._listening():
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("frontends did not start listening")
            time.sleep(0.02)
        return self

    def _listening(self) -> bool:
        return all(getattr(f, "port", None) or getattr(f, "endpoint", None) for f in self.frontends)

    @property
    def frontends(self) -> list[Any]:
        return list(self.handle.frontends)

    def frontend(self, name: str) -> Any:
        return next(f for f in self.frontends if f.name == name)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.frontend('openai').port}"

    @property
    def zmq_endpoint(self) -> str:
        return str(self.frontend("zmq").endpoint)

    @property
    def engine_pid(self) -> int:
        return int(self.handle.supervisor.pid)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.handle is not None and self._thread.is_alive():
            self.handle.stop()
        self._thread.join(timeout_s)
        return self.exit_code


class InProcessEngine:
    """An ``EngineClient`` in the test's own event loop, for the ASGI-level tests: each
    request gets ``params.max_tokens`` tokens (``token``), one per ``step_s``; while
    ``hold`` is clear no request makes progress, so requests pile up in flight. An
    aborted request's stream ends with an "abort" delta, as the real client's does."""

    def __init__(self, token: int = FIRST_TOKEN + 5, step_s: float = 0.0) -> None:
        import asyncio

        self.token = token
        self.step_s = step_s
        self.hold = asyncio.Event()
        self.hold.set()
        self.alive = True
        self.in_flight = 0
        self.num_generated = 0
        self.aborted: list[str] = []

    async def generate(self, request: GenerateRequest) -> Any:
        import asyncio

        self.in_flight += 1
        try:
            limit = request.params.max_tokens or 1
            for i in range(limit):
                await self.hold.wait()
                await asyncio.sleep(self.step_s)
                if request.request_id in self.aborted:
                    yield TokenDelta(request.request_id, [], FinishReason.ABORT)
                    return
                self.num_generated += 1
                done = FinishReason.LENGTH if i + 1 == limit else None
                delta = TokenDelta(request.request_id, [self.token], done)
                if i == 0:
                    delta.num_prompt_tokens = len(request.prompt_token_ids)
                yield delta
        finally:
            self.in_flight -= 1

    async def abort(self, request_ids: Any) -> None:
        self.aborted.extend(request_ids)

    async def stats(self) -> EngineStats:
        return EngineStats(num_running=self.in_flight)

    @property
    def is_alive(self) -> bool:
        return self.alive


def asgi_frontend(model_dir: Any, engine: Any = None, vocab_size: int = 0, **options: Any) -> Any:
    """An ``OpenAIFrontend`` (not listening) over ``engine`` (a new ``InProcessEngine``
    by default), for ``httpx.ASGITransport(frontend.app.starlette)``."""
    from tokenloom.config import make_config
    from tokenloom.plugins.frontends.openai.frontend import OpenAIFrontend
    from tokenloom.text.tokenizer import Tokenizer

    config = make_config({"model": str(model_dir), "max_model_len": 256, **options})
    ready = Ready(
        pid=os.getpid(), max_model_len=config.max_model_len, eos_token_ids=[2],
        vocab_size=vocab_size,
    )  # fmt: skip
    tokenizer = Tokenizer.from_dir(model_dir)
    return OpenAIFrontend(config, engine or InProcessEngine(), tokenizer, ready)
