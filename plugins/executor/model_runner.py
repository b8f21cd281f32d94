"""The ``model`` executor (``plugin.py`` registers it): runs the model on flat batches and
samples on the device.

One process, one device; under tensor parallelism each rank runs one of these on its
own shard (``group``; see ``plugins.executor.parallel``). Per step: build the flat
batch (one host-to-device copy), run the forward pass (a CUDA graph for decode
batches on CUDA), compute logits for the rows that sample, sample on the device, and
copy the sampled ids to pinned host memory. ``execute`` waits for that copy (the step's only host sync); ``submit``
returns at once, so the engine can build the next step while this one runs. The
sampled ids also stay on the device, where the next step's placeholder inputs read
them. A step with a speculating request verifies its drafts and proposes the next
ones instead (``speculative``): its tokens are on the host when ``submit`` returns,
and the engine never pipelines such a step (``engine_core``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.config import EngineConfig, speculation_configured
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.executor import staging
from tokenloom.plugins.executor.batch import BatchBuilder, FlatBatch
from tokenloom.plugins.executor.cuda_graphs import DecodeGraphs
from tokenloom.plugins.executor.memory_profile import profile_num_blocks
from tokenloom.plugins.executor.prompt_logprobs import PromptLogprobs
from tokenloom.plugins.executor.settings import ModelExecutorSettings
from tokenloom.plugins.executor.speculative import SpeculativeDecoder
from tokenloom.plugins.executor.verify_graphs import VerifyGraphs, verify_batch_sizes
from tokenloom.plugins.models import parallel
from tokenloom.protocols.components.attention import ForwardContext
from tokenloom.protocols.components.executor import DoneStep, Executor, PendingStep
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.step import StepInput, StepOutput

if TYPE_CHECKING:
    from tokenloom.plugin_manager import PluginManager

log = logging.getLogger("tokenloom.executor")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30


class ModelRunner(Executor):
    supports_pipelining = True

    def __init__(self, config: EngineConfig, plugins: PluginManager) -> None:
        self.config = config
        self.plugins = plugins
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[config.dtype]
        self.graphs: DecodeGraphs | None = None
        # speculative verify steps, by query tokens per request (1 + k)
        self.verify_graphs: dict[int, VerifyGraphs] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv: torch.Tensor | None = None
        # The tensor-parallel group the model is built for (set before load_model).
        self.group: parallel.ParallelGroup = parallel.SINGLE
        self.memory: dict[str, float] = {}  # GiB
        self.timings: dict[str, float] = {}  # seconds of start-up work

    # ------------------------------------------------------------------ start-up

    def load_model(self) -> ModelInfo:
        from tokenloom.plugins.executor.sampling.sampler import Sampler
        from tokenloom.plugins.models.loader import load_model

        torch.manual_seed(self.config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        started = time.perf_counter()
        self.quant = self.plugins.build("quant", self.config.quant, self.config)
        with parallel.use(self.group):
            self.model, self.info = load_model(
                self.config.model,
                self.dtype,
                self.device,
                registry=self._model_factory,
                random_weights=self.config.load_format == "random",
                prepare=self.quant.prepare_model,
                loaded=self.quant.layer_loaded if self.quant.streams_layers else None,
            )
        self.model.eval()
        self.rank_info = parallel.rank_model_info(self.info, self.group)
        self.attn = self.plugins.build(
            "attention", self.config.attention, self.config, self.rank_info
        )
        self.quant.quantize_model(self.model)
        # config.kv_cache_dtype decides; "auto" leaves it to the weight method (the model's).
        self.kv_dtype = kv_quant.cache_dtype(
            self.config.kv_cache_dtype, self.quant.kv_cache_dtype(self.dtype)
        )
        if kv_quant.is_quantized(self.kv_dtype) and not self.attn.supports_quantized_kv:
            raise ValueError(
                f"attention {self.attn.name!r} cannot read a quantized KV cache "
                f"(kv_cache_dtype={self.config.kv_cache_dtype}); use torch or triton"
            )
        if self.device.type == "cuda":
            self._choose_skinny_gemms()
        self.sampler = Sampler(self.info.vocab_size, self.device)
        self.sampler.warm_up()
        self.prompt_logprobs = PromptLogprobs(self.device)
        self.spec: SpeculativeDecoder | None = None  # speculative decoding, when configured
        if speculation_configured(self.config):
            proposer = self.plugins.build("proposer", self.config.proposer, self.config)
            proposer.bind(self.info)
            self.spec = SpeculativeDecoder(self.config, proposer, self.sampler)
        self.batches = BatchBuilder(
            self.config.block_size, self.device, capacity=2 * self.config.max_num_seqs
        )
        if self.device.type == "cuda":
            self.memory["weights_gib"] = torch.cuda.memory_allocated() / GiB
        log.info("loaded %s in %.1fs", self.info.name, time.perf_counter() - started)
        return self.info

    def _choose_skinny_gemms(self) -> None:
        """The small-batch kernels per linear layer, measured on this GPU
        (``SkinnyDispatch.tune``)."""
        from tokenloom.plugins.models.skinny_dispatch import SkinnyDispatch

        started = time.perf_counter()
        summary = SkinnyDispatch().tune(self.model)
        self.timings["skinny_gemm_s"] = time.perf_counter() - started
        log.info("%s, in %.1fs", summary, self.timings["skinny_gemm_s"])

    def _model_factory(self, architecture: str) -> Any:
        from tokenloom.plugin_manager import PluginError

        try:
            return self.plugins.component("model", architecture).factory
        except PluginError:
            return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        info = self.rank_info
        per_layer = kv_quant.block_bytes(
            block_size, info.num_kv_heads, info.head_dim, self.kv_dtype
        )
        return 2 * info.num_layers * per_layer

    def num_kv_blocks(self, block_size: int) -> int:
        per_block = self.kv_bytes_per_block(block_size)
        if self.device.type != "cuda":
            return max(1, int(self.config.kv_cache_memory_gb * GiB) // per_block)
        return profile_num_blocks(self, block_size, per_block)

    def init_kv_cache(self, num_blocks: int, block_size: int, capture: bool = True) -> None:
        info = self.rank_info
        kv, self.kv_caches = kv_quant.allocate(
            info.num_layers,
            num_blocks,
            block_size,
            info.num_kv_heads,
            info.head_dim,
            self.kv_dtype,
            self.device,
            v_transposed=self.attn.fp8_values_transposed,
        )
        self._kv = kv
        self.block_size = block_size
        if self.device.type == "cuda":
            self.memory["kv_gib"] = kv.numel() * kv.element_size() / GiB
        graphs_ok = self.attn.supports_cuda_graphs
        if capture and self.device.type == "cuda" and not self.config.enforce_eager and graphs_ok:
            self._capture_graphs()
        if capture:
            log.info(
                "KV cache: %d blocks x %d tokens (%s); memory GiB: %s",
                num_blocks,
                block_size,
                self._kv_dtype_note(block_size),
                ", ".join(f"{k}={v:.2f}" for k, v in self.memory.items()),
            )

    def _kv_dtype_note(self, block_size: int) -> str:
        """The pool's dtype; a quantized one also says how many more blocks it holds
        than the model dtype would in the same memory (scales included)."""
        name, model = (str(d).removeprefix("torch.") for d in (self.kv_dtype, self.dtype))
        if not kv_quant.is_quantized(self.kv_dtype):
            return name
        info = self.info
        plain = kv_quant.block_bytes(block_size, info.num_kv_heads, info.head_dim, self.dtype)
        gain = 2 * info.num_layers * plain / self.kv_bytes_per_block(block_size)
        return f"{name} with per-token-head scales, {gain:.2f}x the {model} blocks"

    def _micro_batches(self) -> tuple[int, bool, int]:
        """``[plugin.model]``'s micro_batch_min (0 under tensor parallelism: the halves'
        collectives would share one communicator), micro_batch_turns and micro_batch_sms."""
        from tokenloom.config import plugin_settings

        settings = plugin_settings(self.config, "model", ModelExecutorSettings)
        split = (settings.micro_batch_turns, settings.micro_batch_sms)
        if settings.micro_batch_min and self.group.size > 1:
            log.warning("micro_batch_min: one GPU only; off under tensor parallelism")
            return 0, *split
        return settings.micro_batch_min, *split

    def _capture_graphs(self) -> None:
        before = torch.cuda.memory_allocated()
        max_len = self.config.max_model_len or self.info.max_model_len
        self.graphs = DecodeGraphs(
            self.model,
            self.attn,
            self.kv_caches,
            min(self.config.max_num_seqs, self.config.max_graph_batch),
            -(-max_len // self.block_size),
            max_len,
            self.info.hidden_size,
            self.dtype,
            self.device,
            *self._micro_batches(),
        )
        self.graphs.capture()
        self.verify_graphs = self._verify_graphs(-(-max_len // self.block_size), max_len)
        pool = None
        for verify in self.verify_graphs.values():
            pool = verify.capture(pool=pool)
        self.memory["graphs_gib"] = (torch.cuda.memory_allocated() - before) / GiB
        self.timings["graph_capture_s"] = self.graphs.capture_seconds
        if self.verify_graphs:
            self.timings["verify_graph_capture_s"] = sum(
                v.capture_seconds for v in self.verify_graphs.values()
            )

    def _verify_graphs(self, max_blocks_per_seq: int, max_len: int) -> dict[int, VerifyGraphs]:
        """Static batches of ``1 + k`` tokens per request for each ``k`` up to
        ``num_speculative_tokens`` (uncaptured), when this runner verifies drafts and
        ``max_verify_graph_seqs`` > 0; keyed by ``1 + k``."""
        cfg = self.config
        sizes = verify_batch_sizes(cfg.max_num_seqs, cfg.max_verify_graph_seqs)
        if self.spec is None or not sizes:
            return {}
        return {
            k + 1: VerifyGraphs(
                self.model,
                self.attn,
                self.kv_caches,
                k,
                sizes,
                max_blocks_per_seq,
                max_len,
                self.info.hidden_size,
                self.dtype,
                self.device,
            )  # fmt: skip
            for k in range(cfg.num_speculative_tokens, 0, -1)
        }

    # ------------------------------------------------------------------ steps

    def execute(self, step: StepInput) -> StepOutput:
        return self.submit(step).result()

    @torch.inference_mode()
    def submit(self, step: StepInput) -> PendingStep:
        sampler = self.sampler
        batches = self.batches
        staging.begin_step(self.device)
        if step.finished_request_ids:
            sampler.remove_requests(step.finished_request_ids)
            batches.remove_requests(step.finished_request_ids)
            self.prompt_logprobs.remove_requests(step.finished_request_ids)
            if self.spec is not None:
                self.spec.remove_requests(step.finished_request_ids)
        for new in step.new_requests:
            sampler.add_request(new)
            batches.add_request(new.request_id)
            self.prompt_logprobs.add_request(new)
            if self.spec is not None:
                self.spec.add_request(new)
        if not step.chunks:
            return DoneStep(StepOutput(step.step_id, [], []))
        graphed = self._graph_decode(step)
        if graphed is not None:
            hidden, request_ids, token_slots = graphed
            rows = hidden
        else:
            batch = batches.build(step)
            hidden = self._forward(batch)
            request_ids, token_slots = batch.sample_request_ids, batch.sample_slots
            rows = hidden if batch.sample_index is None else hidden[batch.sample_index]
        if self.prompt_logprobs.wanted():
            self.prompt_logprobs.record(step.chunks, hidden, self.model.compute_logits)
        if not request_ids:
            return DoneStep(StepOutput(step.step_id, [], []))
        logits = self.model.compute_logits(rows)
        if self.spec is not None and self.spec.speculating(step.chunks):
            # verify drafts, then propose: host tokens (the engine runs this step alone)
            prompt_values = self.prompt_logprobs.take(step.chunks, request_ids)
            spec_output = self.spec.sample(
                step.step_id, step.chunks, logits, request_ids, prompt_values,
                lambda last: batches.store_sampled_tokens(token_slots, last),
            )  # fmt: skip
            return DoneStep(spec_output)
        result = sampler.sample(logits, request_ids, (batches.last_tokens, token_slots.int()))
        sampler.count_sampled(request_ids, result)
        if not result.stored:
            batches.store_sampled_tokens(token_slots, result.token_ids)
        prompt_values = self.prompt_logprobs.take(step.chunks, request_ids)
        return result.copy_to_host(step.step_id, request_ids, prompt_values)

    def _graph_decode(self, step: StepInput) -> tuple[torch.Tensor, list[str], torch.Tensor] | None:
        """A decode-only step that a captured graph takes, run: ``(hidden, request ids,
        token slots)``; None for any other step."""
        graphs = self.graphs
        if graphs is None or not graphs.can_run(len(step.chunks), True):
            return None
        pack = self.batches.pack_decode(step)
        if pack is None:
            return None
        hidden, token_slots = graphs.run_pack(pack, self.batches.last_tokens)
        return hidden, pack.request_ids, token_slots

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        meta = batch.meta
        if self.graphs is not None and self.graphs.can_run(batch.num_seqs, meta.decode_only):
            return self.graphs.run(batch.input_ids, batch.positions, meta)
        verify = self.verify_graphs.get(meta.max_query_len) if self.verify_graphs else None
        if verify is not None and verify.can_run(
            batch.num_seqs, batch.num_tokens, meta.max_query_len
        ):
            return verify.run(batch.input_ids, batch.positions, meta)
        self.attn.prepare(meta)
        ctx = ForwardContext(attn=self.attn, meta=meta, kv_caches=self.kv_caches)
        return self.model(batch.input_ids, batch.positions, ctx)

    def shutdown(self) -> None:
        self.graphs = None
        self.verify_graphs = {}
        self.free_kv_cache()

    def free_kv_cache(self) -> None:
        """Drop the KV pool (the memory profile's trial pool; shutdown)."""
        self.kv_caches = []
        self._kv = None
