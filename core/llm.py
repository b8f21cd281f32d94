"""The offline API: ``LLM(model_dir).generate(prompts, params)``.

Runs the engine in this process (no sockets): the same scheduler, executor and
output processor as the server, driven by a plain loop.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenloom.config import load_config
from tokenloom.engine.loop import engine_gc
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.engine_core import Engine
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.text.request_output import RequestOutput

Prompt = str | list[int]


class LLM:
    """An engine and its tokenizer, for batch generation in this process.

    ``model`` is a checkpoint directory or a .gguf file; empty means the built-in
    default, SmolLM2-135M-Instruct (``tokenloom.checkpoints.default_model.default_model``).
    ``engine_options`` are ``EngineConfig`` fields (``max_num_seqs=64``,
    ``dtype="float32"``, ``scheduler="static"``, ``tensor_parallel_size=2``, ...);
    ``plugins`` are extra plugin objects (modules or instances with ``@hookimpl``
    functions) to register.
    """

    def __init__(
        self,
        model: str = "",
        config: str | None = None,
        plugins: Sequence[object] = (),
        **engine_options: Any,
    ) -> None:
        from tokenloom.engine.engine_core import Engine
        from tokenloom.plugin_manager import PluginManager
        from tokenloom.text.output_processor import OutputProcessor
        from tokenloom.text.tokenizer import Tokenizer

        pm = PluginManager.default()
        for i, plugin in enumerate(plugins):
            pm.register(plugin, f"user-plugin-{i}")
        self.engine: Engine = Engine.from_config(
            load_config(config, model=model or None, **engine_options), pm
        )
        self.tokenizer = Tokenizer.from_dir(self.engine.config.model)
        self.processor = OutputProcessor(self.tokenizer, stream=False)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the device and stop the tensor-parallel workers (if any); the LLM
        is unusable afterwards. Workers also stop when this process exits."""
        self.engine.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len or self.engine.info.max_model_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params)} sampling params")
        encoded = [p if not isinstance(p, str) else self.tokenizer.encode(p) for p in prompt_list]
        for i, ids in enumerate(encoded):
            if not ids or len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(ids)} tokens; a prompt needs 1 to "
                    f"{self.max_model_len - 1} tokens (max_model_len {self.max_model_len})"
                )
        pending: deque[GenerateRequest] = deque()
        order: list[str] = []
        for i, (prompt, ids, sp) in enumerate(zip(prompt_list, encoded, params, strict=True)):
            text = prompt if isinstance(prompt, str) else None
            pending.extend(self._requests(text, ids, sp, priority[i] if priority else 0, order))
        try:
            # The served engine-core's collector settings while the engine steps: with
            # Python's defaults a young collection runs about once per decode step at
            # hundreds of sequences and a full one (tens of ms, the GPU idle) every
            # ~100 steps. Restored when the call returns.
            with engine_gc():
                return self._run(pending, order, use_tqdm)
        except BaseException:
            # Interrupted or failed: leave nothing of this call running in the engine.
            for request_id in order:
                self.engine.abort(self.processor.abort_request(request_id))
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals

    def _requests(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        order: list[str],
    ) -> list[GenerateRequest]:
        request_id = str(next(self._ids))
        order.append(request_id)
        return self.processor.add_request(
            request_id,
            text,
            ids,
            params,
            self.engine.info.eos_token_ids,
            priority=priority,
            arrival_time=time.monotonic(),
        )

    def _run(
        self, pending: deque[GenerateRequest], order: list[str], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(order)) if use_tqdm else None
        started = time.perf_counter()
        prompt_tokens = output_tokens = 0
        while pending or engine.has_unfinished():
            while pending:
                try:
                    engine.add_request(pending[0])
                except QueueFullError:
                    break
                pending.popleft()
            deltas = engine.step()
            for delta in deltas:
                output_tokens += len(delta.new_token_ids)
                prompt_tokens += delta.num_prompt_tokens
            result = self.processor.process(deltas)
            if result.abort_ids:
                self.processor.process(engine.abort(result.abort_ids))
            for out in result.outputs:
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        elapsed = max(time.perf_counter() - started, 1e-9)
                        bar.set_postfix_str(
                            f"in {prompt_tokens / elapsed:,.0f} tok/s, "
                            f"out {output_tokens / elapsed:,.0f} tok/s",
                            refresh=False,
                        )
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[rid] for rid in order]


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
