"""Quant plugin ``int8``: weight-only int8 (W8A16), one symmetric scale per output
channel, quantized at load from the 16/32-bit checkpoint, stored ``[N, K]``, or read from a
compressed-tensors checkpoint of int8 weights per channel (``compressed_tensors``).

``q = round(w / s)`` in ``[-127, 127]`` with ``s = max|w_row| / 127``. On the GPU the
layer runs the Triton kernels of ``kernels.weight_gemm``: ``int8_gemv_nk`` for decode
batches (whole rows of ``[N, K]`` per program, no K split), int8 tiles converted in
registers for ``tl.dot`` above, the scale applied once to the accumulator. Elsewhere, and as the kernel's oracle, the reference
path dequantizes the weight and calls ``F.linear``. Activations stay 16-bit, so the
only error is the weights' rounding (half a step of ``max|w_row| / 127``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.common import (
    OneRowEpilogueKernel,
    WeightQuantMethod,
    flat,
    keep,
    quantization_config,
)
from tokenloom.protocols.components.quant import LinearKernel, QkvRope
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

if TYPE_CHECKING:
    from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig

log = logging.getLogger(__name__)

QMAX = 127


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(qweight [K, N] int8, scales [1, N] float32)``: ``qweight`` is
    the GEMM's logical ``[K, N]``, stored ``[N, K]`` (the transposed view of a contiguous
    ``[N, K]`` tensor: each output channel's weights contiguous, what the one-row GEMV
    ``int8_gemv_nk`` streams; the other kernels read it through its strides)."""
    w32 = w.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-12) / QMAX  # [N]
    q = torch.round(w32 / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q.contiguous().t(), scales[None, :].contiguous()


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` that ``quantize_int8`` stored."""
    return (qweight.t().float() * scales.t()).to(dtype)


class Int8Kernel(OneRowEpilogueKernel):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.qweight = qweight  # [K, N] int8 (a view of [N, K] storage)
        self.scales = scales  # [1, N] float32
        self.configs = None  # the Triton GEMM's tiling per batch-size bucket (GPU only)
        if qweight.is_cuda and dtype in (torch.float16, torch.bfloat16):
            from tokenloom.plugins.quant.kernels.dispatch import choose_configs

            self.configs = choose_configs(
                qweight, scales, None, 8, 0, dtype, lambda x: self.reference(x.float(), None)
            )

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and self.configs is not None:
            from tokenloom.plugins.quant.kernels.dispatch import bucket
            from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

            x2 = flat(x)
            cfg = self.configs[bucket(x2.shape[0])]
            y = weight_gemm(x2, self.qweight, self.scales, None, 8, 0, bias, cfg)
            return y.view(*x.shape[:-1], y.shape[-1])
        return self.reference(x, bias)

    @property
    def offers_qkv_rope(self) -> bool:
        """Where the layer's one-row tiling is ``int8_gemv_nk`` (callers build no
        ``QkvRope`` for a kernel that would decline every call)."""
        from tokenloom.plugins.quant.kernels.dispatch import bucket
        from tokenloom.plugins.quant.kernels.int8_gemv_nk import epilogues_on

        if self.configs is None or not epilogues_on():
            return False
        one_row = self.configs[bucket(1)]
        return one_row.nk and one_row.rows == 1

    def launch_fused(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        cfg: GemmConfig,
        silu: bool,
        rope: QkvRope | None,
    ) -> torch.Tensor | None:
        """``int8_gemv_nk`` with the epilogue (``TOKENLOOM_INT8_EPILOGUES=0`` turns them
        off: ``int8_nk_fused``)."""
        from tokenloom.plugins.quant.kernels.int8_gemv_nk import int8_nk_fused

        return int8_nk_fused(x, self.qweight, self.scales, bias, cfg, silu=silu, rope=rope)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Dequantize, then ``F.linear`` (the CPU path and the GPU kernel's oracle)."""
        return F.linear(x, dequantize_int8(self.qweight, self.scales, x.dtype), bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` as ``q * scale`` (one scale a row): a tied embedding's lookups."""
        q = self.qweight.t()[ids]  # [*ids, K] int8, from the [N, K] storage
        return (q.to(torch.float32) * self.scales[0, ids].unsqueeze(-1)).to(dtype)


class Int8Quant(WeightQuantMethod):
    name = "int8"
    # The head in int8 measured +0.06% perplexity on the built-in model against +0.15%
    # without (the 1% bound), and -0.11 ms of a 2.94 ms Llama-3-8B step on the H200
    # (docs/quantization.md, "The LM head"); ``--no-quant-lm-head`` keeps it 16-bit.
    lm_head_default = True
    serves_rows = True  # Int8Kernel.rows: a tied embedding's lookups
    checkpoint: Any = None  # compressed_tensors.Int8Checkpoint when pre-quantized

    @classmethod
    def reads_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        from tokenloom.plugins.quant.compressed_tensors import scheme_for

        qc = quantization_config
        return super().reads_checkpoint(qc) or scheme_for(qc, "int8") is not None

    def prepare_model(self, model: nn.Module, hf_config: dict[str, Any]) -> None:
        """A compressed-tensors checkpoint of int8 weights (the only pre-quantized int8
        format read): each layer's tensors load as stored (``Int8Checkpoint``)."""
        qc = quantization_config(hf_config)
        if qc is None:
            return
        from tokenloom.plugins.quant import compressed_tensors as ct

        if not ct.is_compressed_tensors(qc):
            raise ValueError(
                f"--quant int8: the checkpoint is quantized with {qc.get('quant_method')!r}"
            )
        scheme = ct.require(qc, "int8", model)
        if scheme.activations is not None:
            log.info("int8: the checkpoint's activations are quantized too; served W8A16")
        self.checkpoint = ct.Int8Checkpoint(scheme)
        self.prequantized = True
        self.prepared = self.checkpoint.prepare(model)

    def finish_kernel(self, layer: Linear) -> LinearKernel:
        q, scales = self.checkpoint.convert(layer)
        return Int8Kernel(
            keep(layer, "qweight", q.t()), keep(layer, "weight_scale", scales), layer.weight.dtype
        )

    def make_kernel(self, layer: Linear) -> LinearKernel:
        qweight, scales = quantize_int8(layer.weight.data)
        return Int8Kernel(
            keep(layer, "qweight", qweight), keep(layer, "weight_scale", scales), layer.weight.dtype
        )


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "quant",
            "int8",
            Int8Quant,
            "int8 weights (W8A16), per-channel scales, Triton GEMM; compressed-tensors checkpoints",
        )
    ]
