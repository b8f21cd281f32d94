"""Proposer plugin ``draft``: a smaller model with the target's tokenizer drafts.

The draft model (``draft_model``: a Hugging Face directory or a GGUF file) is
loaded next to the target, with its own paged KV pool and block tables, and runs
greedily: each ``propose`` first catches the draft's cache up with the request's
new tokens (one batched forward on the extend path), then runs ``k - 1`` batched
decode steps (in CUDA graphs on the GPU, unless ``enforce_eager``). The drafts are the draft model's argmax, a deterministic (one-hot)
proposal, so the target's rejection sampler stays exact for sampled requests.
KV written for drafts that the target accepted is kept (the next catch-up starts
after the longest accepted prefix); the rest is rewritten.

Options (``[plugin.draft]``): ``dtype`` (default: the target's), ``quant`` (a weight
quantization method for the draft alone, as ``--quant`` names them: ``int8``, ``int4``,
``fp8``; default ``none``, whatever the target uses), ``max_pool_tokens``
(default 262144: the draft's KV pool in tokens; a request that does not fit gets no
drafts that step), ``cuda_graphs`` (default true). A draft whose vocabulary size differs from the target's fails at
start-up (``bind``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from tokenloom.config import EngineConfig, plugin_settings
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.step import NewRequestData, ScheduledChunk, StepInput

if TYPE_CHECKING:
    import torch

    from tokenloom.plugins.executor.cuda_graphs import DecodeGraphs
    from tokenloom.protocols.components.model import ModelInfo

DTYPES = ("float32", "float16", "bfloat16")


class _DraftRequest:
    __slots__ = ("blocks", "num_valid", "written")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_valid = 0  # leading history tokens whose draft KV is right
        self.written: list[int] = []  # drafts whose KV follows them (positions num_valid..)


class DraftSettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.draft]``: the draft's dtype ("" = the target's) and weight
    quantization, KV pool size in tokens, and whether its decode steps replay CUDA
    graphs."""

    dtype: str = ""
    quant: str = "none"
    max_pool_tokens: int = 1 << 18
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        # Checked with the rest of the config (check_config decodes these settings), so
        # a misspelt method fails before the target's weights load. The draft builds
        # its method from the default plugin set, so that is the set asked here.
        from tokenloom.plugin_manager import PluginError, PluginManager

        try:
            PluginManager.default().component("quant", self.quant)
        except PluginError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None


class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, config: EngineConfig) -> None:
        if not config.draft_model:
            raise ValueError('draft_model: the "draft" proposer needs a model directory or GGUF')
        options = plugin_settings(config, "draft", DraftSettings)
        self.config = config
        self.dtype_name = options.dtype or config.dtype
        if self.dtype_name not in DTYPES:
            raise ValueError(f"plugin.draft.dtype: one of {', '.join(DTYPES)}")
        self.quant_name = options.quant
        self.max_pool_tokens = options.max_pool_tokens
        self.use_graphs = options.cuda_graphs and not config.enforce_eager
        self.graphs: DecodeGraphs | None = None
        self._requests: dict[str, _DraftRequest] = {}

    # ------------------------------------------------------------------ start-up

    def bind(self, target: ModelInfo) -> None:
        import torch

        from tokenloom.plugin_manager import PluginManager
        from tokenloom.plugins.executor.batch import BatchBuilder
        from tokenloom.plugins.models.loader import load_model

        config = self.config
        # The target's own device object (cuda:N): the draft's small uploads then share
        # the target's per-step staging buffers, which the executor rewinds each step.
        self.device = torch.device(target.device)
        dtype = getattr(torch, self.dtype_name)
        plugins = self.plugins or PluginManager.default()  # the engine's, where it built us
        # The draft's own weight method: the target's config with the draft's ``quant``.
        draft_config = msgspec.structs.replace(config, quant=self.quant_name)
        quant = plugins.build("quant", self.quant_name, draft_config)
        self.model, self.info = load_model(
            config.draft_model,
            dtype,
            self.device,
            random_weights=config.load_format == "random",
            prepare=quant.prepare_model,
            loaded=quant.layer_loaded if quant.streams_layers else None,
        )
        self.model.eval()
        quant.quantize_model(self.model)
        if self.info.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft_model: its vocabulary ({self.info.vocab_size} tokens) differs from the "
                f"target's ({target.vocab_size}); a draft must share the target's tokenizer"
            )
        info = self.info
        self.attn = plugins.build("attention", config.attention, config, info)
        self.block_size = bs = config.block_size
        max_len = min(config.max_model_len or target.max_model_len, target.max_model_len)
        pool_tokens = min(self.max_pool_tokens, config.max_num_seqs * (max_len + bs))
        num_blocks = max(1, -(-pool_tokens // bs))
        shape = (info.num_layers, 2, num_blocks, bs, info.num_kv_heads, info.head_dim)
        kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(info.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))
        self.batches = BatchBuilder(bs, self.device, capacity=2 * config.max_num_seqs)
        if self.use_graphs and self.device.type == "cuda" and self.attn.supports_cuda_graphs:
            from tokenloom.plugins.executor.cuda_graphs import DecodeGraphs

            span = max_len + 64  # a request's positions plus its drafts
            self.graphs = DecodeGraphs(
                self.model,
                self.attn,
                self.kv_caches,
                min(config.max_num_seqs, config.max_graph_batch),
                -(-span // bs),
                span,
                info.hidden_size,
                dtype,
                self.device,
            )
            self.graphs.capture()

    # ------------------------------------------------------------------ requests

    def add_request(self, data: NewRequestData) -> None:
        if data.request_id not in self._requests:
            self._requests[data.request_id] = _DraftRequest()
            self.batches.add_request(data.request_id)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        gone = []
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is not None:
                self._free.extend(state.blocks)
                gone.append(request_id)
        self.batches.remove_requests(gone)

    # ------------------------------------------------------------------ drafting

    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        import torch

        drafts: dict[str, list[int]] = {}
        chunks: list[ScheduledChunk] = []
        lengths: dict[str, int] = {}
        for request_id, history, k in zip(request_ids, token_histories, num_tokens, strict=True):
            state = self._requests.get(request_id)
            if state is None or k <= 0:
                continue
            size = len(history)
            valid = state.num_valid
            for token in state.written:  # accepted drafts keep their KV
                if valid >= size - 1 or history[valid] != token:
                    break
                valid += 1
            if not self._reserve(state, size + k - 1):
                continue
            chunks.append(ScheduledChunk(request_id, list(history[valid:]), valid, state.blocks))
            state.num_valid = size
            state.written = []
            lengths[request_id] = size
            drafts[request_id] = []
        if not chunks:
            return [[] for _ in request_ids]
        with torch.inference_mode():
            last = self._forward(chunks)
            steps = max(num_tokens)
            for step in range(steps):
                for chunk, token in zip(chunks, last, strict=True):
                    drafts[chunk.request_id].append(token)
                chunks = [
                    ScheduledChunk(c.request_id, [t], lengths[c.request_id] + step, c.block_ids)
                    for c, t, k in zip(
                        chunks, last, self._ks(chunks, request_ids, num_tokens), strict=True
                    )
                    if step + 1 < k
                ]
                if not chunks:
                    break
                last = self._forward(chunks)
                for chunk in chunks:
                    self._requests[chunk.request_id].written.append(chunk.token_ids[0])
        return [drafts.get(r, []) for r in request_ids]

    def _ks(
        self, chunks: list[ScheduledChunk], request_ids: Sequence[str], num_tokens: Sequence[int]
    ) -> list[int]:
        wanted = dict(zip(request_ids, num_tokens, strict=True))
        return [wanted[c.request_id] for c in chunks]

    def _forward(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One draft forward over ``chunks``; the argmax after each chunk's last token."""
        from tokenloom.protocols.components.attention import ForwardContext

        step = StepInput(0, chunks, num_tokens=sum(len(c.token_ids) for c in chunks))
        batch = self.batches.build(step)
        meta = batch.meta
        if self.graphs is not None and self.graphs.can_run(batch.num_seqs, meta.decode_only):
            hidden = self.graphs.run(batch.input_ids, batch.positions, meta)
        else:
            self.attn.prepare(meta)
            ctx = ForwardContext(attn=self.attn, meta=meta, kv_caches=self.kv_caches)
            hidden = self.model(batch.input_ids, batch.positions, ctx)
        rows = hidden if batch.sample_index is None else hidden[batch.sample_index]
        logits: torch.Tensor = self.model.compute_logits(rows)
        return logits.argmax(dim=-1).tolist()

    def _reserve(self, state: _DraftRequest, num_tokens: int) -> bool:
        """Blocks for positions ``< num_tokens``; False (taking none) when the pool is dry."""
        missing = -(-num_tokens // self.block_size) - len(state.blocks)
        if missing > len(self._free):
            return False
        for _ in range(max(missing, 0)):
            state.blocks.append(self._free.pop())
        return True


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "proposer",
            "draft",
            DraftProposer,
            "draft-model drafts (greedy)",
            settings=DraftSettings,
        )
    ]
