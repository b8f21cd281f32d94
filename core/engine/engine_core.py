"""The in-process engine: the components the config names, wired together.

``Engine.step()`` is one iteration of the engine-core: schedule, execute, update.
The engine-core loop (``engine.loop``) and the offline ``LLM`` both drive it; the
hot path is direct method calls on the built components.

With async scheduling (``async_scheduling``, on for CUDA) the iteration is
pipelined: schedule and submit step N+1, then wait for step N and fold its tokens
in. The host's work for the next step (scheduling, batch building, launches) and
for the last one (update, output processing by the caller) overlaps the device's
current step. Step N+1's inputs that depend on step N's tokens are placeholders the
executor fills on the device. A request that stops by itself in step N has already
been scheduled in step N+1; that one token of work is discarded.

Speculative decoding composes with it: pipelined while no speculating request is
live, synchronous while one is. A verify step's drafts are proposed from the
previous step's tokens on the host, so while a request with ``k > 0`` (see
``plugins.executor.speculative.speculative_tokens``) is queued or running, ``step``
first finishes the step in flight, then schedules and runs the next one to
completion; once the last one finishes, pipelining resumes (its first step has no
pending tokens, so placeholders only ever refer to steps sampled on the device).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.config import ConfigError, EngineConfig, speculation_configured, speculative_tokens
from tokenloom.protocols.control import Ready
from tokenloom.protocols.outputs import EngineStats, TokenDelta
from tokenloom.protocols.requests import GenerateRequest

if TYPE_CHECKING:
    from tokenloom.plugin_manager import PluginManager
    from tokenloom.protocols.components.executor import Executor, PendingStep
    from tokenloom.protocols.components.kv_cache import KVCacheManager
    from tokenloom.protocols.components.model import ModelInfo
    from tokenloom.protocols.components.scheduler import Scheduler
    from tokenloom.protocols.step import StepInput

log = logging.getLogger("tokenloom.engine.engine_core")


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Fill the "auto" choices from the machine: device, dtype, attention, model."""
    import torch

    changes: dict[str, Any] = {}
    device = config.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            'device: "cuda" was asked for, but torch sees no CUDA GPU on this machine '
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
            'use device = "cpu", or "auto" to take a GPU when there is one'
        )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        changes["device"] = device
    if config.dtype == "auto":
        changes["dtype"] = "bfloat16" if device == "cuda" else "float32"
    if config.attention == "auto":
        changes["attention"] = "triton" if device == "cuda" else "torch"
    if not config.model:
        from tokenloom.checkpoints.default_model import default_model

        changes["model"] = default_model()
    return msgspec.structs.replace(config, **changes) if changes else config


def resolve_quant(config: EngineConfig, plugins: Any) -> EngineConfig:
    """``quant = "none"`` (the default) on a checkpoint whose config.json says it is
    quantized (``quantization_config``): the registered method that loads that format
    (``protocols.components.quant.checkpoint_quant``), as vLLM reads it from the
    checkpoint. A format none loads raises ConfigError, as does ``quant_lm_head`` on a
    model that stays 16-bit; other configs come back as they are (a .gguf file, a named
    shape, random weights: the loader has its own checks)."""
    import json
    from pathlib import Path

    from tokenloom.protocols.components.quant import checkpoint_quant

    path = Path(config.model or "") / "config.json"
    if config.quant != "none" or config.load_format == "random" or not path.is_file():
        return _head_needs_a_method(config)
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return config  # the loader names the problem
    if not isinstance(hf_config, dict):
        return _head_needs_a_method(config)
    try:
        name = checkpoint_quant(hf_config, plugins)
    except ValueError as exc:
        raise ConfigError(f"quant: {exc}") from None
    if name is None:
        return _head_needs_a_method(config)
    log.info("quant: %s, as the checkpoint's quantization_config says", name)
    return msgspec.structs.replace(config, quant=name)


def _head_needs_a_method(config: EngineConfig) -> EngineConfig:
    """``quant_lm_head`` on a model that stays 16-bit: checked here, once the
    checkpoint's own method is known (a quantized checkpoint needs no ``--quant``)."""
    if config.quant_lm_head and config.quant == "none":
        raise ConfigError("quant_lm_head: needs a weight quantization method (--quant)")
    return config


def async_scheduling_enabled(config: EngineConfig, executor: Executor) -> bool:
    """Whether the engine runs async scheduling: ``async_scheduling``, where None
    means on for CUDA; the executor must support pipelining. With speculative
    decoding the engine still runs synchronous steps while a request speculates
    (``Engine.step``)."""
    wanted = config.async_scheduling
    supported = executor.supports_pipelining
    if wanted is None:
        return supported and config.device == "cuda"
    if wanted and not supported:
        raise ValueError(
            f"async_scheduling: executor {config.executor!r} does not support pipelining; "
            "set async_scheduling = false"
        )
    return wanted


class Engine:
    """Scheduler + KV cache manager + executor, built from one config: the default
    ``EngineCore`` (``protocols.components.engine``)."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        kv_cache: KVCacheManager,
        executor: Executor,
        info: ModelInfo,
        plugins: PluginManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock  # the scheduler's clock too: RequestMetrics times are on it
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.executor = executor
        self.info = info
        self.plugins = plugins
        # Output-token totals for tokenloom_request_finished, kept only when a plugin
        # observes it: the hot path pays nothing otherwise.
        self._observed = bool(
            plugins is not None and plugins.hook.tokenloom_request_finished.get_hookimpls()
        )
        self._num_output: dict[str, int] = {}
        self._observed_first = bool(
            plugins is not None and plugins.hook.tokenloom_request_first_token.get_hookimpls()
        )
        self._observed_added = bool(
            plugins is not None and plugins.hook.tokenloom_request_added.get_hookimpls()
        )
        self.pipelined = async_scheduling_enabled(config, executor)
        self._in_flight: tuple[StepInput, PendingStep] | None = None
        # Pipelined with a proposer: the ids of the live requests that speculate
        # (k > 0); while there is one, steps run synchronously.
        self._track_speculation = self.pipelined and speculation_configured(config)
        self.speculating: set[str] = set()

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        plugins: PluginManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Engine:
        """Build every component the config names. The config is checked first
        (component names, ``[plugin.NAME]`` settings, the device), so a mistake fails
        in milliseconds, before the model's weights load."""
        from tokenloom.plugin_manager import PluginManager

        pm = plugins or PluginManager.default()
        if config.num_speculative_tokens and config.proposer == "none":
            raise ValueError(
                "num_speculative_tokens: speculative decoding needs a proposer "
                '(proposer = "ngram", "draft", ...); got proposer = "none"'
            )
        pm.check_config(config)
        config = resolve_quant(resolve_config(config), pm)
        pm.configure(config)
        started = time.perf_counter()
        executor = pm.build("executor", config.executor, config, pm)
        info = executor.load_model()
        max_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
        config = msgspec.structs.replace(config, max_model_len=max_len)
        min_blocks = -(-max_len // config.block_size)
        num_blocks = config.num_blocks or min(
            executor.num_kv_blocks(config.block_size),
            # More blocks than every running sequence at full length can use only
            # serve the prefix cache; cap them so small models do not hoard memory.
            4 * config.max_num_seqs * min_blocks,
        )
        if num_blocks < min_blocks:
            log.warning(
                "KV pool of %d blocks holds fewer than one sequence of max_model_len %d; "
                "long prompts will be refused",
                num_blocks,
                max_len,
            )
        kv = pm.build("kv_cache", config.kv_cache, config, num_blocks, config.block_size)
        scheduler = pm.build("scheduler", config.scheduler, config, kv, clock=clock)
        executor.init_kv_cache(num_blocks, config.block_size)
        engine = cls(config, scheduler, kv, executor, info, pm, clock)
        pm.hook.tokenloom_components_built(
            components={"scheduler": scheduler, "kv_cache": kv, "executor": executor}
        )
        log.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks x %d tokens = %d tokens, "
            "async scheduling %s",
            time.perf_counter() - started,
            info.name,
            config.device,
            config.dtype,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            engine._async_note(),
        )
        return engine

    # ------------------------------------------------------------------ requests

    def add_request(self, request: GenerateRequest) -> None:
        if not request.eos_token_ids and self.info.eos_token_ids:
            request.eos_token_ids = list(self.info.eos_token_ids)
        self.scheduler.add_request(request)
        if self._track_speculation and speculative_tokens(self.config, request.params) > 0:
            self.speculating.add(request.request_id)
        if self._observed_added and self.plugins is not None:
            self.plugins.hook.tokenloom_request_added(
                request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids)
            )

    def abort(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        deltas = self.scheduler.abort_requests(list(request_ids))
        self._observe_finished(deltas)
        return deltas

    def step(self) -> list[TokenDelta]:
        scheduler = self.scheduler
        if not self.pipelined:
            step = scheduler.schedule()
            if not step.chunks and not step.finished_request_ids:
                return []
            deltas = scheduler.update(step, self.executor.execute(step))
        elif self.speculating:
            deltas = self._step_synchronously()
        else:
            step = scheduler.schedule()
            submitted = None
            if step.chunks or step.finished_request_ids:
                submitted = (step, self.executor.submit(step))
            in_flight, self._in_flight = self._in_flight, submitted
            if in_flight is None:
                return []
            deltas = scheduler.update(in_flight[0], in_flight[1].result())
        self._observe_finished(deltas)
        return deltas

    def _step_synchronously(self) -> list[TokenDelta]:
        """Pipelined engine, a speculating request live: finish the step in flight,
        then schedule and run the next one to completion (its drafts need the tokens
        on the host). The deltas of both."""
        scheduler = self.scheduler
        deltas: list[TokenDelta] = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            deltas = scheduler.update(in_flight[0], in_flight[1].result())
        step = scheduler.schedule()
        if step.chunks or step.finished_request_ids:
            deltas += scheduler.update(step, self.executor.execute(step))
        return deltas

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def ready_info(self) -> Ready:
        import os

        return Ready(
            pid=os.getpid(),
            model_name=self.info.name,
            max_model_len=self.config.max_model_len or self.info.max_model_len,
            num_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=list(self.info.eos_token_ids),
            vocab_size=self.info.vocab_size,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _async_note(self) -> str:
        """The start-up log's word on async scheduling."""
        if not self.pipelined:
            return "off"
        return "on, synchronous while speculating" if self._track_speculation else "on"

    def _observe_finished(self, deltas: list[TokenDelta]) -> None:
        speculating = self.speculating
        if speculating:
            for delta in deltas:
                if delta.finish_reason is not None:
                    speculating.discard(delta.request_id)
        if self.plugins is None:
            return
        if self._observed_first:
            hook = self.plugins.hook.tokenloom_request_first_token
            for delta in deltas:  # only a first delta carries num_prompt_tokens
                if delta.num_prompt_tokens and delta.new_token_ids:
                    hook(
                        request_id=delta.request_id,
                        num_prompt_tokens=delta.num_prompt_tokens,
                        num_cached_tokens=delta.num_cached_tokens,
                    )
        if not self._observed:
            return
        counts = self._num_output
        for delta in deltas:
            total = counts.get(delta.request_id, 0) + len(delta.new_token_ids)
            if delta.finish_reason is None:
                counts[delta.request_id] = total
                continue
            counts.pop(delta.request_id, None)
            self.plugins.hook.tokenloom_request_finished(
                request_id=delta.request_id,
                finish_reason=delta.finish_reason,
                num_output_tokens=total,
                metrics=delta.metrics,
            )
