"""The Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

One implementation; the architectures differ only in the switches of
``ArchFeatures`` (biases on q/k/v, per-head q/k RMSNorm) and in config values
(rope, head_dim, tied embeddings). Input is a flat batch without padding:
``model(input_ids [T], positions [T], ctx) -> hidden [T, hidden]``; attention goes
through ``ctx.attn`` over the paged KV cache of each layer.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.plugins.models import parallel, pdl
from tokenloom.plugins.models.fused_gemv import (
    add_norm,
    norm_and_project,
    project_rope,
    project_silu,
)
from tokenloom.plugins.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    Slots,
    fused,
    whole,
)
from tokenloom.plugins.models.rope import RotaryEmbedding, apply_rotary, rope_parameters
from tokenloom.protocols.components.attention import ForwardContext, RopeInputs
from tokenloom.protocols.components.quant import QkvRope

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) at the batch's positions, [T, 1, D/2]


@dataclass(frozen=True)
class ArchFeatures:
    """What sets one Llama-family architecture apart from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, hf_config: dict[str, Any]) -> ArchFeatures:
        model_type = hf_config.get("model_type", "")
        attention_bias = bool(hf_config.get("attention_bias", False))
        if model_type == "qwen2":
            return cls(qkv_bias=True)
        if model_type == "qwen3":
            return cls(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
        if model_type == "mistral":
            return cls()
        return cls(qkv_bias=attention_bias, o_bias=attention_bias)


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> DecoderShape:
        num_heads = c["num_attention_heads"]
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
        if c.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        return cls(
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            vocab_size=c["vocab_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_positions=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        features: ArchFeatures,
        layer_index: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        group = parallel.current()
        head_dim = self.head_dim = shape.head_dim
        # this rank's heads (see plugins.models.parallel for the rule)
        q_rows = parallel.head_range(shape.num_heads, head_dim, group.size, group.rank)
        kv_rows = parallel.head_range(shape.num_kv_heads, head_dim, group.size, group.rank)
        self.q_size, self.kv_size = q_rows[1] - q_rows[0], kv_rows[1] - kv_rows[0]
        self.num_heads, self.num_kv_heads = self.q_size // head_dim, self.kv_size // head_dim
        self.scale = shape.head_dim**-0.5
        full_q, full_kv = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
        self.qkv_proj = Linear(
            shape.hidden_size,
            (full_q, full_kv, full_kv),
            features.qkv_bias,
            dtype,
            "column",
            (q_rows, kv_rows, kv_rows),
        )
        self.qkv_proj.fusable = "norm"  # the input norm may run inside its one-row GEMV
        self.o_proj = Linear(full_q, (shape.hidden_size,), features.o_bias, dtype, "row")
        self.q_norm = (
            RMSNorm(shape.head_dim, shape.rms_norm_eps, dtype) if features.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(shape.head_dim, shape.rms_norm_eps, dtype) if features.qk_norm else None
        )

    def forward(self, rope: Rope, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.attend(rope, self.qkv_proj(hidden), ctx)

    def qkv_rope(self, rope: Rope, ctx: ForwardContext, hidden: torch.Tensor) -> QkvRope | None:
        """What the q/k/v projection's kernel needs to rotate q and k and store k and v
        itself (``QkvRope``): one decode token on a GPU, a quantized kernel, no per-head
        norm, a 16-bit cache the backend lets the model write. None otherwise."""
        kernel = self.qkv_proj.kernel
        if hidden.shape[0] != 1 or not hidden.is_cuda or kernel is None:
            return None
        if not kernel.offers_qkv_rope:
            return None
        if self.q_norm is not None or not ctx.attn.accepts_written_kv or not ctx.meta.decode_only:
            return None
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        if k_cache.dtype != hidden.dtype:
            return None
        half = self.head_dim // 2
        cos, sin = (t.reshape(1, half) for t in rope)
        return QkvRope(
            cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
            k_cache, v_cache, ctx.meta.slot_mapping,
        )  # fmt: skip

    def attend(
        self, rope: Rope, qkv: torch.Tensor, ctx: ForwardContext, rotated: bool = False
    ) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] (the projection's output) -> o_proj's output;
        ``rotated``: q and k already rotated, k and v already in the cache (the
        projection's kernel did it: ``qkv_rope``)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        written: dict[str, Any] = {}
        norms = (self.q_norm, self.k_norm)
        q_w, k_w = (n.weight if n is not None else None for n in norms)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        if rotated:
            written["kv_written"] = True
        elif fused(q) and ctx.attn.accepts_rope:
            # the backend norms, rotates and stores k/v (in its decode kernel: none here)
            written["rope"] = RopeInputs(*rope, q_w, k_w, eps)
        elif fused(q):
            from tokenloom.plugins.models import rope_ops

            # The backend may let the rope kernel write the KV cache (one kernel less).
            kv_write = None
            if ctx.attn.accepts_written_kv:
                kv_write = (v, k_cache, v_cache, ctx.meta.slot_mapping)
                written["kv_written"] = True
            rope_ops.qk_norm_rope_(q, k, *rope, q_w, k_w, eps, kv_write)  # in place, in qkv
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, *rope)
        out = ctx.attn.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, **written)
        with pdl.next_reads_weights_first():  # the add+norm follows
            return self.o_proj(out.reshape(tokens, self.q_size))

    def slots(self, prefix: str) -> Slots:
        result = self.qkv_proj.slots([f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")])
        result.update(self.o_proj.slots([f"{prefix}.o_proj"]))
        if self.q_norm is not None and self.k_norm is not None:
            result[f"{prefix}.q_norm.weight"] = whole(self.q_norm.weight)
            result[f"{prefix}.k_norm.weight"] = whole(self.k_norm.weight)
        return result


class LlamaMLP(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        super().__init__()
        inter = shape.intermediate_size
        self.gate_up_proj = Linear(shape.hidden_size, (inter, inter), False, dtype, "column")
        self.gate_up_proj.fusable = "norm+silu"
        self.down_proj = Linear(inter, (shape.hidden_size,), False, dtype, "row")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(project_silu(self.gate_up_proj, hidden, self.down_proj))

    def slots(self, prefix: str) -> Slots:
        result = self.gate_up_proj.slots([f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        result.update(self.down_proj.slots([f"{prefix}.down_proj"]))
        return result


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        features: ArchFeatures,
        layer_index: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(shape, features, layer_index, dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(shape, dtype)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); the caller adds them lazily. The
        norms (and SiLU) run inside the projections' kernels where those take them
        (``norm_and_project``: one-row decode)."""
        attn, mlp = self.self_attn, self.mlp
        fused = attn.qkv_rope(rope, ctx, hidden)
        if fused is None:
            qkv, residual = norm_and_project(self.input_layernorm, attn.qkv_proj, hidden, residual)
            rotated = False
        else:  # the rotation and the cache stores in the projection's epilogue, if it can
            hidden, residual = add_norm(self.input_layernorm, hidden, residual)
            projected = project_rope(attn.qkv_proj, hidden, fused)
            rotated = projected is not None
            qkv = projected if projected is not None else attn.qkv_proj(hidden)
        hidden = attn.attend(rope, qkv, ctx, rotated)
        act, residual = norm_and_project(
            self.post_attention_layernorm,
            mlp.gate_up_proj,
            hidden,
            residual,
            silu=True,
            then=mlp.down_proj,
        )
        return mlp.down_proj(act), residual

    def slots(self, prefix: str) -> Slots:
        result = {
            f"{prefix}.input_layernorm.weight": whole(self.input_layernorm.weight),
            f"{prefix}.post_attention_layernorm.weight": whole(
                self.post_attention_layernorm.weight
            ),
        }
        result.update(self.self_attn.slots(f"{prefix}.self_attn"))
        result.update(self.mlp.slots(f"{prefix}.mlp"))
        return result


class LlamaModel(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        features: ArchFeatures,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size, dtype)
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(shape, features, i, dtype) for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        steps = self.forward_steps(input_ids, positions, ctx)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def forward_steps(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[None, None, torch.Tensor]:
        """``forward`` one decoder layer a step: launches the embedding and the first
        layer, yields, the next layer, ... and returns the final hidden states with the
        last layer and the final norm. The executor interleaves two micro-batches' steps
        (``plugins.executor.micro_batches``)."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary(positions)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if i:
                yield
            hidden, residual = layer(rope, hidden, residual, ctx)
        assert residual is not None  # there is at least one layer
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM: ``forward`` gives final hidden states, ``compute_logits`` the
    float32 logits of the rows the sampler needs (usually one per request).

    Built as ``LlamaForCausalLM(hf_config, dtype)`` on the current default device;
    parameters are uninitialised until the loader fills the ``checkpoint_slots()``.
    """

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = DecoderShape.from_config(hf_config)
        self.features = ArchFeatures.from_config(hf_config)
        rotary = RotaryEmbedding(
            self.shape.head_dim, self.shape.max_positions, rope_parameters(hf_config), dtype
        )
        self.model = LlamaModel(self.shape, self.features, rotary, dtype)
        # vocab-parallel like the embedding (see plugins.models.parallel)
        self.lm_head = (
            self.model.embed_tokens
            if self.shape.tie_word_embeddings
            else Embedding(self.shape.vocab_size, self.shape.hidden_size, dtype)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids [T] int32 or int64, positions [T] int64 -> hidden [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def forward_steps(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[None, None, torch.Tensor]:
        """``forward`` a decoder layer at a time (``LlamaModel.forward_steps``)."""
        return self.model.forward_steps(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, the full vocabulary on every
        rank (gathered from the vocab-parallel head)."""
        return self.lm_head.logits(hidden).float()

    def checkpoint_slots(self) -> Slots:
        """Every tensor the checkpoint must hold, by its Hugging Face name."""
        result: Slots = {"model.embed_tokens.weight": self.model.embed_tokens.slot()}
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            result.update(layer.slots(f"model.layers.{i}"))
        result["model.norm.weight"] = whole(self.model.norm.weight)
        if not self.shape.tie_word_embeddings:
            result["lm_head.weight"] = self.lm_head.slot()
        return result

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may hold that this model does not need."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return self.shape.tie_word_embeddings and name == "lm_head.weight"
