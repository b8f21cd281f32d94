"""Quant plugin ``fp8``: W8A8 in float8 e4m3, one weight scale per output channel and a
dynamic scale per token for the activations.

Weights come from a 16/32-bit checkpoint (quantized at load: ``s_w = max|w_row| / 448``)
or from an fp8 checkpoint whose ``quantization_config`` says ``quant_method: fp8``, read
as vLLM reads it: each projection's ``weight`` (e4m3) with its per-tensor
``weight_scale`` (and ``input_scale`` for a static activation scheme, read but not
used: dynamic per-token scales are at least as fine). A merged projection's parts keep
their own scales, spread over their rows, so nothing is quantized twice. Checkpoints
with one scale per output channel (``quant_method: fbgemm_fp8``: ``weight_scale [N, 1]``
float32, dynamic per-token activations, what ``tokenloom quantize --method fp8``
writes) load their scales as they are (``activation_scale_ub`` is not applied). Block-wise
checkpoints (``weight_block_size``, a ``weight_scale_inv`` per block) are dequantized
after loading and quantized again per channel, one layer at a time. compressed-tensors
checkpoints of float 8-bit weights (per tensor, channel or block) load the same way
(``compressed_tensors``).

Each call quantizes the activations per token (``s_x = max|x_row| / 448``). On a GPU
with fp8 tensor cores (compute capability 8.9+) the GEMM is ``torch._scaled_mm`` with
row-wise scales; elsewhere, and as its oracle, the reference path dequantizes both
operands and multiplies in float32, with the same rounding of ``x`` and ``w`` to e4m3.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.plugins.models.layers import Linear, Slots, WeightSlot
from tokenloom.plugins.quant.common import (
    ParamShapes,
    WeightQuantMethod,
    block_slot,
    flat,
    is_skipped,
    keep,
    prepare_checkpoint_layers,
    quantization_config,
    row_slot,
    weight_parts,
)
from tokenloom.plugins.quant.kernels.fp8_gemv import GEMV_ROWS, fp8_gemv, gemv_offered
from tokenloom.protocols.components.quant import Fp8Rows, LinearKernel
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, C]`` -> ``(e4m3 [R, C], scales [R, 1] float32)``, one scale per row."""
    t32 = t.float()
    amax = t32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # A true division by a tensor: on CUDA, dividing by a Python number multiplies by its
    # reciprocal, one rounding away from the fused kernel's IEEE division (div_rn).
    scales = amax / torch.full_like(amax, FP8_MAX)
    return (t32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


@cache
def _has_fp8_mma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Kernel(LinearKernel):
    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = weight  # [N, K] e4m3
        self.scales = scales  # [N, 1] float32
        self.mma_shape = weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0  # _scaled_mm
        # rows up to which the fp8 GEMV serves (opt-in until measured on the GPU; read
        # once here, not per call: ~130 calls per decode step)
        self.gemv_rows = GEMV_ROWS if gemv_offered() else 0

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = flat(x)
        fp8_gpu = x.dtype in (torch.float16, torch.bfloat16) and _has_fp8_mma(x.device)
        if fp8_gpu and (x2.shape[0] <= self.gemv_rows or self.mma_shape):
            from tokenloom.plugins.quant.kernels.fp8_quant import per_token_fp8

            y = self.apply_fp8_rows(Fp8Rows(*per_token_fp8(x2), x.dtype), bias)
        else:
            y = self.reference(x2, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """The GPU paths (the GEMV, ``torch._scaled_mm``) quantize the rows first: a 2-D
        16-bit input on a GPU with fp8 tensor cores, at the GEMV's rows or where the
        shape suits ``_scaled_mm`` (as ``apply`` dispatches)."""
        return (
            x.dim() == 2
            and x.dtype in (torch.float16, torch.bfloat16)
            and _has_fp8_mma(x.device)
            and (x.shape[0] <= self.gemv_rows or self.mma_shape)
        )

    def apply_fp8_rows(self, x: Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        """A few rows: the fp8 GEMV (``kernels/fp8_gemv.py``), which streams the weight
        instead of padding a GEMM; more: ``torch._scaled_mm`` (fp8 tensor cores), both
        scales applied in the GEMM."""
        if x.q.shape[0] <= self.gemv_rows:  # masked tiles: any N and K
            return fp8_gemv(x.q, x.scales, self.weight, self.scales, bias, x.dtype)
        y = torch._scaled_mm(
            x.q,
            self.weight.t(),  # [K, N] column-major, as _scaled_mm wants its second operand
            scale_a=x.scales,
            scale_b=self.scales.t(),
            out_dtype=torch.bfloat16,
        )
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same quantization of ``x``, then dequantized operands in float32."""
        xq, x_scales = quantize_fp8_rows(x)
        w = self.weight.float() * self.scales
        y = F.linear(xq.float() * x_scales, w)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def fp8_kernel(layer: Linear, weight: torch.Tensor, scales: torch.Tensor) -> Fp8Kernel:
    return Fp8Kernel(keep(layer, "weight_fp8", weight), keep(layer, "weight_scale", scales))


class Fp8Quant(WeightQuantMethod):
    name = "fp8"
    checkpoint_formats = ("fp8", "fbgemm_fp8")
    static_input = False  # the checkpoint has input_scale tensors (read, not used)
    block: tuple[int, int] | None = None  # weight_block_size of a block-wise checkpoint
    per_channel = False  # fbgemm_fp8: weight_scale [N, 1], one per output row
    block_scale_name = "weight_scale_inv"  # a block-wise checkpoint's scale tensors

    @classmethod
    def reads_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        from tokenloom.plugins.quant.compressed_tensors import scheme_for

        qc = quantization_config
        return super().reads_checkpoint(qc) or scheme_for(qc, "fp8") is not None

    def prepare_model(self, model: nn.Module, hf_config: dict[str, Any]) -> None:
        qc = quantization_config(hf_config)
        if qc is None:
            return
        from tokenloom.plugins.quant import compressed_tensors as ct

        method = qc.get("quant_method")
        if ct.is_compressed_tensors(qc):
            scheme = ct.require(qc, "fp8", model)
            self.per_channel = scheme.strategy == "channel"
            self.block = scheme.block if scheme.strategy == "block" else None
            self.block_scale_name = "weight_scale"
            acts = scheme.activations
            self.static_input = bool(ct.static_inputs(scheme))
            if acts is None:
                log.info("fp8: the checkpoint's activations are 16-bit; served W8A8 all the "
                         "same, one scale per token")  # fmt: skip
            skip = scheme.ignores
        elif method in ("fp8", "fbgemm_fp8"):
            self.per_channel = method == "fbgemm_fp8"
            block = qc.get("weight_block_size")
            self.block = (int(block[0]), int(block[1])) if block else None
            self.static_input = qc.get("activation_scheme", "dynamic") == "static"
            skipped = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])

            def skip(prefixes: list[str]) -> bool:
                return is_skipped(prefixes, skipped)
        else:
            raise ValueError(f"--quant fp8: the checkpoint is quantized with {method!r}")
        self.prequantized = True
        self.prepared |= prepare_checkpoint_layers(model, skip, self._shapes, self._slots)

    def _shapes(self, name: str, layer: Linear) -> ParamShapes:
        parts, n, k = len(layer.output_sizes), layer.out_features, layer.in_features
        shapes: ParamShapes = {
            "weight_fp8": ((n, k), FP8),
            "part_scales": ((parts,), torch.float32),
            "input_scales": ((parts,), torch.float32),
        }
        if self.per_channel:
            shapes["row_scales"] = ((n, 1), torch.float32)
        if self.block is not None:
            bn, bk = self.block
            if any(size % bn for size in layer.output_sizes):
                raise ValueError(f"{name}: output parts {layer.output_sizes} cut {bn}-row blocks")
            shapes["block_scales"] = ((n // bn, -(-k // bk)), torch.float32)
        return shapes

    def _slots(self, layer: Linear, dense: Slots) -> Slots:
        """Each part's ``weight`` into the fp8 rows, its scale(s) into one element."""
        result: Slots = {}
        for prefix, part, slot in weight_parts(dense, result):  # the bias stays 16-bit
            result[f"{prefix}.weight"] = WeightSlot(
                layer.weight_fp8, slot.start, slot.stop, slot.source, slot.source_size
            )
            if self.block is not None:
                result[f"{prefix}.{self.block_scale_name}"] = block_slot(
                    layer.block_scales, slot, self.block
                )
            elif self.per_channel:  # the rows' scales: sharded with the rows, not the inputs
                result[f"{prefix}.weight_scale"] = row_slot(layer.row_scales, slot)
            else:
                result[f"{prefix}.weight_scale"] = WeightSlot(layer.part_scales, part, part + 1)
            if self.static_input:
                result[f"{prefix}.input_scale"] = WeightSlot(layer.input_scales, part, part + 1)
        return result

    def make_kernel(self, layer: Linear) -> LinearKernel:
        weight, scales = quantize_fp8_rows(layer.weight.data)
        return fp8_kernel(layer, weight, scales)

    def finish_kernel(self, layer: Linear) -> LinearKernel:
        if self.block is not None:  # per block -> per channel: dequantize, quantize again
            bn, bk = self.block
            n, k = layer.weight_fp8.shape
            scales = layer.block_scales.data.repeat_interleave(bn, 0)
            w = layer.weight_fp8.data.float() * scales.repeat_interleave(bk, 1)[:, :k]
            weight, row_scales = quantize_fp8_rows(w)
            del layer.weight_fp8, layer.block_scales, layer.part_scales, layer.input_scales
            return fp8_kernel(layer, weight, row_scales)
        if self.per_channel:
            scales = layer.row_scales.data
            del layer.row_scales, layer.part_scales, layer.input_scales
            return Fp8Kernel(layer.weight_fp8.data, keep(layer, "weight_scale", scales))
        sizes = torch.tensor(layer.output_sizes, device=layer.part_scales.device)
        scales = layer.part_scales.float().repeat_interleave(sizes)[:, None].contiguous()
        del layer.part_scales, layer.input_scales
        return Fp8Kernel(layer.weight_fp8.data, keep(layer, "weight_scale", scales))


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "quant",
            "fp8",
            Fp8Quant,
            "fp8 e4m3 weights and activations (W8A8), per-channel and per-token scales; "
            "fp8, fbgemm_fp8 and compressed-tensors checkpoints",
        )
    ]
