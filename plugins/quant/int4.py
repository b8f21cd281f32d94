"""Quant plugin ``int4``: weight-only 4-bit (W4A16), groups of 128 input rows with
a scale and a zero point each.

Weights come either from a 16/32-bit checkpoint, quantized at load by round-to-
nearest (``quantize_int4``: per group an asymmetric grid of 16 steps over the group's
range and 0, with an integer zero point), or from an AWQ or GPTQ checkpoint,
whose ``quantization_config`` names the format (``int4_checkpoints``), or from a
GGUF file's own Q4_0/Q4_1 blocks (groups of 32, ``gguf_int4``). All end in
one layout, the GEMM's: ``qweight [K / 8, N]`` int32 (nibble ``j`` of word ``i`` is
input row ``8 i + j``), ``scales`` and ``zeros`` ``[G, N]`` in the model's dtype, and
``w = (q - z) * s``. A layer whose ``K`` is no multiple of 128 has a shorter last group;
``[plugin.int4] group_size`` sets another size for RTN.

On the GPU the layer runs the Triton GEMM of ``kernels.weight_gemm`` (dequantized per
element in the kernel; a K-split weight stream for batches of at most 16 rows, square
tiles above). Elsewhere, and as its oracle, the reference path dequantizes and calls
``F.linear``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.config import EngineConfig, plugin_settings
from tokenloom.plugins.models.gguf import SOURCE_KEY
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.common import (
    OneRowEpilogueKernel,
    WeightQuantMethod,
    flat,
    keep,
    quantization_config,
)
from tokenloom.plugins.quant.int4_pack import pack_int4, unpack_int4
from tokenloom.protocols.components.quant import LinearKernel, QkvRope
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

if TYPE_CHECKING:
    from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig

log = logging.getLogger(__name__)

GROUP_SIZE = 128


def quantize_int4(
    w: torch.Tensor, group: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``w [N, K]`` -> ``(qweight [K/8, N] int32, scales [G, N],
    zeros [G, N])``, scales and zeros in ``w``'s dtype (zeros are the integers 0..15).

    Each group's grid spans its range widened to hold 0 (``s = (max(hi, 0) - min(lo,
    0)) / 15``) with an integer zero point, so 0 is a grid point, as in GPTQ and AWQ.
    Measured on the built-in model, two variants with less squared error did worse:
    a fractional zero point (the exact range; perplexity +72% against +27% on a subset:
    the many weights near 0 all round the same way, and their errors add up) and a
    least-squares clipping search (it cuts the outliers, the weights that matter)."""
    n, k = w.shape
    num_groups = -(-k // group)
    padded = torch.zeros(n, num_groups * group, dtype=torch.float32, device=w.device)
    padded[:, :k] = w.float()
    grouped = padded.view(n, num_groups, group)
    # a partial last group takes its range from its real columns only
    real = (torch.arange(num_groups * group, device=w.device) < k).view(1, num_groups, group)
    lo = grouped.masked_fill(~real, float("inf")).amin(dim=2).clamp(max=0.0)
    hi = grouped.masked_fill(~real, float("-inf")).amax(dim=2).clamp(min=0.0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(w.dtype).float()  # rounded as stored
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(grouped / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).view(n, -1)[:, :k]
    return pack_int4(q.t()), scales.t().to(w.dtype).contiguous(), zeros.t().to(w.dtype).contiguous()


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype``: ``(q - z) * s`` per group."""
    q = unpack_int4(qweight).float()  # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group
    w = (q - zeros.float()[groups]) * scales.float()[groups]
    return w.t().to(dtype)


class Int4Kernel(OneRowEpilogueKernel):
    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
    ) -> None:
        self.qweight = qweight  # [K / 8, N] int32 (int4_kernel: stored [N, K / 8])
        self.scales = scales  # [G, N] model dtype
        self.zeros = zeros  # [G, N] model dtype
        self.group = group
        self.configs = None  # the Triton GEMM's tiling per batch-size bucket (GPU only)
        if qweight.is_cuda and scales.dtype in (torch.float16, torch.bfloat16):
            from tokenloom.plugins.quant.kernels.dispatch import choose_configs

            self.configs = choose_configs(
                qweight,
                scales,
                zeros,
                4,
                group,
                scales.dtype,
                lambda x: self.reference(x.float(), None),
            )

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and self.configs is not None:
            from tokenloom.plugins.quant.kernels.dispatch import bucket
            from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

            x2 = flat(x)
            cfg = self.configs[bucket(x2.shape[0])]
            y = weight_gemm(x2, self.qweight, self.scales, self.zeros, 4, self.group, bias, cfg)
            return y.view(*x.shape[:-1], y.shape[-1])
        return self.reference(x, bias)

    @property
    def offers_qkv_rope(self) -> bool:
        from tokenloom.plugins.quant.kernels.int4_qkv_rope import rope_epilogue_on

        return self.configs is not None and rope_epilogue_on()

    def launch_fused(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        cfg: GemmConfig,
        silu: bool,
        rope: QkvRope | None,
    ) -> torch.Tensor | None:
        """``int4_gemv_nk`` with the epilogue (``TOKENLOOM_INT4_FUSED_SILU=0`` /
        ``TOKENLOOM_INT4_FUSED_ROPE=0`` turn them off: ``int4_nk_fused``)."""
        from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_fused

        args = (x, self.qweight, self.scales, self.zeros, self.group, bias, cfg)
        return int4_nk_fused(*args, silu=silu, rope=rope)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Dequantize, then ``F.linear`` (the CPU path and the GPU kernel's oracle)."""
        w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group, x.dtype)
        return F.linear(x, w, bias)


def row_major_storage() -> bool:
    return os.environ.get("TOKENLOOM_INT4_ROW_MAJOR", "1") != "0"


def int4_kernel(
    layer: Linear, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> Int4Kernel:
    """The kernel of ``layer`` over these tensors, which are registered on the layer.
    Where ``int4_gemv_nk`` can serve the layer (bf16 on sm_90+; groups of a multiple of
    32), the words are stored row-major per output channel (``[N, K / 8]``, ``qweight``
    its transposed view), the layout it streams at one row (docs/quantization.md,
    sessions 17-18); elsewhere, or with ``TOKENLOOM_INT4_ROW_MAJOR=0``, ``[K / 8, N]``,
    the layout of the GEMVs and the f16x2 GEMV."""
    from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_serves

    k = qweight.shape[0] * 8
    if row_major_storage() and int4_nk_serves(layer.weight.dtype, qweight.device, group, k):
        if not qweight.t().is_contiguous():  # int4_tiles.int4_row_major
            qweight = qweight.t().contiguous().t()
    elif not qweight.is_contiguous():  # a checkpoint's [N, K / 8] words (compressed-tensors)
        qweight = qweight.contiguous()
    return Int4Kernel(
        keep(layer, "qweight", qweight),
        # the GPU kernels read both as contiguous [G, N] (a reader may hand views)
        keep(layer, "scales", scales.to(layer.weight.dtype).contiguous()),
        keep(layer, "qzeros", zeros.to(layer.weight.dtype).contiguous()),
        group,
    )


class Int4Settings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.int4]``: the group size of RTN at load (a checkpoint's own wins), and
    whether a GGUF file's Q4_0/Q4_1 linears keep their own blocks (groups of 32, no
    second rounding; ``gguf_blocks = false`` rounds them again by RTN)."""

    group_size: int = GROUP_SIZE
    gguf_blocks: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 8 or self.group_size % 8:
            raise ValueError("group_size must be a positive multiple of 8")


class Int4Quant(WeightQuantMethod):
    """RTN at load, or an AWQ / GPTQ checkpoint as its ``quantization_config`` says."""

    name = "int4"
    checkpoint_formats = ("awq", "gptq")
    # the head in int8 unless the config says otherwise: its own 4 bits cost +45.6%
    # perplexity on the built-in model; int8's cost ~0.1% and halve the head's bytes
    # (docs/quantization.md, session 17)
    lm_head_default = "int8"

    @classmethod
    def reads_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        from tokenloom.plugins.quant.compressed_tensors import scheme_for

        qc = quantization_config
        return super().reads_checkpoint(qc) or scheme_for(qc, "int4") is not None

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.settings = plugin_settings(config, "int4", Int4Settings)
        self.group = self.settings.group_size
        self.checkpoint: Any = None  # int4_checkpoints.Int4Checkpoint when pre-quantized
        self.gguf: Any = None  # gguf_int4.GGUFBlocks of a GGUF file with 4-bit linears

    def prepare_model(self, model: nn.Module, hf_config: dict[str, Any]) -> None:
        qc = quantization_config(hf_config)
        if qc is None:
            source = hf_config.get(SOURCE_KEY)
            if source and self.settings.gguf_blocks:
                from tokenloom.plugins.quant.gguf_int4 import BLOCK, GGUFBlocks

                blocks = GGUFBlocks(source, hf_config, model)
                if len(blocks):
                    log.info(
                        "int4: %d layers keep the GGUF file's Q4_0/Q4_1 blocks (groups of %d)",
                        len(blocks),
                        BLOCK,
                    )
                    self.gguf = blocks
            return
        from tokenloom.plugins.quant import compressed_tensors as ct
        from tokenloom.plugins.quant.int4_checkpoints import Int4Checkpoint, PackedInt4Checkpoint

        if ct.is_compressed_tensors(qc):
            self.checkpoint = PackedInt4Checkpoint(ct.require(qc, "int4", model))
        else:
            self.checkpoint = Int4Checkpoint.from_config(qc)
        self.group = self.checkpoint.group
        self.prequantized = True
        self.prepared = self.checkpoint.prepare(model)

    def make_kernel(self, layer: Linear) -> LinearKernel:
        if self.gguf is not None and (blocks := self.gguf.convert(layer)) is not None:
            from tokenloom.plugins.quant.gguf_int4 import BLOCK

            return int4_kernel(layer, *blocks, BLOCK)
        qweight, scales, zeros = quantize_int4(layer.weight.data, self.group)
        return int4_kernel(layer, qweight, scales, zeros, self.group)

    def finish_kernel(self, layer: Linear) -> LinearKernel:
        assert self.checkpoint is not None
        qweight, scales, zeros, perm = self.checkpoint.convert(layer)
        kernel = int4_kernel(layer, qweight, scales, zeros, self.group)
        if perm is None:
            return kernel
        from tokenloom.plugins.quant.common import PermutedInputKernel

        return PermutedInputKernel(kernel, keep(layer, "input_perm", perm))


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "quant",
            "int4",
            Int4Quant,
            "4-bit weights (W4A16), groups of 128; RTN at load, AWQ, GPTQ and "
            "compressed-tensors checkpoints, GGUF Q4_0/Q4_1 blocks",
            settings=Int4Settings,
        )
    ]
