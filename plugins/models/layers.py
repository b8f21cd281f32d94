"""Building blocks shared by the decoder models: linear and embedding layers that
skip random init, RMSNorm with a fused residual add, and the map from checkpoint
tensors to parameters (rotary embeddings: ``rope.py``).

Parameters are created with ``torch.empty`` on the current default device (the
loader builds models under ``with torch.device(device)``); the loader then fills
them (a ``Linear``'s weight allocated at its first write where the loader defers it). A merged projection (q/k/v, gate/up) is one parameter whose row ranges
receive several checkpoint tensors; ``WeightSlot`` names such a range.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.plugins.models import parallel as parallel_state
from tokenloom.protocols.components.quant import PermutedRows

if TYPE_CHECKING:
    from tokenloom.protocols.components.quant import Fp8Rows, LinearKernel


@dataclass(frozen=True)
class WeightSlot:
    """Rows ``[start, stop)`` of ``param`` receive one checkpoint tensor, or, with
    ``source`` = ``(dim, begin, end)``, only that range of the checkpoint tensor along
    ``dim`` (this rank's shard; the loader reads no more of the file than that).
    ``source_size`` is the checkpoint tensor's full length along ``dim``, checked."""

    param: nn.Parameter
    start: int
    stop: int
    source: tuple[int, int, int] | None = None
    source_size: int | None = None
    owner: Linear | None = None  # a deferred weight's layer: allocates it at first write

    def target(self) -> torch.Tensor:
        if self.owner is not None:
            self.owner.materialize_weight()
        return self.param.data.narrow(0, self.start, self.stop - self.start)


Slots = dict[str, WeightSlot]


def whole(param: nn.Parameter) -> WeightSlot:
    return WeightSlot(param, 0, param.shape[0])


LinearParallel = Literal["replicated", "column", "row"]

# Set by the loader (``loader.deferred_weights``): ``Linear`` layers built meanwhile get
# their dense weight at the loader's first write (``materialize_weight``).
DEFERRED = ContextVar("tokenloom_deferred_linear_weights", default=False)


def fused_offered() -> bool:
    """``TOKENLOOM_FUSED_NORM_GEMV=0`` keeps the one-row GEMV with the norm folded in
    (``fused_gemv``) out of the choice and out of the forward pass."""
    return os.environ.get("TOKENLOOM_FUSED_NORM_GEMV", "1") != "0"


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``output_sizes`` splits the rows into merged projections.

    The one place where a linear layer is sharded and quantized:

    - ``parallel`` (see ``plugins.models.parallel``): ``replicated`` holds the whole
      weight; ``column`` holds, of each merged part ``i``, the checkpoint rows
      ``part_ranges[i]`` (default: an even split across the ranks) and leaves its
      output sharded; ``row`` holds an even split of the input columns and all-reduces
      its output, adding the bias once after the sum.
    - ``kernel`` (a ``protocols.components.quant.LinearKernel``, set by a quant method
      after loading): computes ``x W^T`` from its own, quantized copy of this rank's
      shard; ``weight`` is then released (an empty tensor). None: dense GEMM, with the
      skinny Triton GEMM for small batches where it measured faster (``skinny``).

    ``output_sizes``/``in_features`` are this rank's (local) sizes after sharding.
    """

    # A config of the skinny Triton GEMM, set where it measured faster than cuBLAS
    # (``SkinnyDispatch``); used for inputs of at most 16 rows (small-batch decode).
    skinny: tuple[int, int, int, int] | None = None
    # A config of the one-row GEMV (``skinny_gemm.gemv``), set where it measured faster
    # at one row than cuBLAS or the skinny GEMM; used for inputs of one row (decode at
    # batch 1).
    gemv: tuple[int, int, int] | None = None
    # Declared by the model: the norm before this layer ("norm"), and SiLU-and-mul after
    # it ("norm+silu"), may run inside its one-row GEMV (``fused_gemv.norm_and_project``).
    fusable: Literal["norm", "norm+silu"] | None = None
    # The config of that fused GEMV (``fused_gemv.norm_gemv``), set where it measured
    # faster than the norm kernel and ``gemv`` apart.
    fused: tuple[int, int, int] | None = None
    kernel: LinearKernel | None = None
    # Set by a quant method's prepare_model for a pre-quantized checkpoint: maps the
    # dense slots below to the slots of the checkpoint's quantized tensors.
    slot_hook: Callable[[Linear, Slots], Slots] | None = None

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        parallel: LinearParallel = "replicated",
        part_ranges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        group = self.group = parallel_state.current()
        self.parallel = parallel
        self.full_output_sizes = list(output_sizes)
        self.full_in_features = in_features
        if parallel == "column" and group.size > 1:
            if part_ranges is None:
                part_ranges = [
                    parallel_state.even_range(n, group.size, group.rank) for n in output_sizes
                ]
        elif part_ranges is None:
            part_ranges = [(0, n) for n in output_sizes]
        self.part_ranges = list(part_ranges)
        self.output_sizes = [stop - start for start, stop in self.part_ranges]
        self.in_range = (0, in_features)
        if parallel == "row" and group.size > 1:
            self.in_range = parallel_state.even_range(in_features, group.size, group.rank)
        self.in_features = self.in_range[1] - self.in_range[0]
        out_features = sum(self.output_sizes)
        self.out_features = out_features
        self.deferred = DEFERRED.get()  # the weight [0, in] until first written
        rows = 0 if self.deferred else out_features
        self.weight = nn.Parameter(torch.empty(rows, self.in_features, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        # row-parallel: every rank's partial sum would add the bias; add it after the sum
        self._reduce = parallel == "row" and group.size > 1

    def materialize_weight(self) -> None:
        """Allocate a deferred dense weight (uninitialised; same device and dtype, so the
        Parameter that checkpoint slots hold stays the same object)."""
        if self.deferred:  # not one a quant method released
            w, self.deferred = self.weight, False
            w.data = torch.empty(
                self.out_features, self.in_features, dtype=w.dtype, device=w.device
            )

    def forward(self, x: torch.Tensor | Fp8Rows | PermutedRows) -> torch.Tensor:
        """``x``: the input rows, ``Fp8Rows`` where ``takes_fp8_rows`` said yes, or
        ``PermutedRows`` gathered into ``input_order``."""
        bias = None if self._reduce else self.bias
        if isinstance(x, PermutedRows):
            assert self.kernel is not None
            y = self.kernel.apply_permuted(x.x, bias)
        elif not isinstance(x, torch.Tensor):
            assert self.kernel is not None
            y = self.kernel.apply_fp8_rows(x, bias)
        elif self.kernel is not None:
            y = self.kernel.apply(x, bias)
        elif self.gemv is not None and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            from tokenloom.plugins.models.skinny_gemm import gemv

            y = gemv(x, self.weight, self.gemv, bias)
        elif self.skinny is not None and x.dim() == 2 and x.shape[0] <= 16 and x.stride(1) == 1:
            from tokenloom.plugins.models.skinny_gemm import skinny_gemm

            y = skinny_gemm(x, self.weight, self.skinny, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if self._reduce:
            y = self.group.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    @property
    def input_order(self) -> torch.Tensor | None:
        """The order in which the kernel's weights keep their inputs (None: as the model
        computes them): the kernel before may store its rows so (``PermutedRows``)."""
        return None if self.kernel is None else self.kernel.input_order

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether the kernel before may hand this layer ``x``'s rows quantized per token
        (``Fp8Rows``, the quantization folded into that kernel: ``fused_ops``' norm and
        SiLU-and-mul) rather than ``x``. On by default since session 39 measured it
        (docs/quantization.md); ``TOKENLOOM_FP8_FOLD_QUANT=0`` (read at each call) keeps
        the quantization in the kernel's own launch."""
        return (
            self.kernel is not None
            and os.environ.get("TOKENLOOM_FP8_FOLD_QUANT", "1") != "0"
            and self.kernel.takes_fp8_rows(x)
        )

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether ``fused_gemv.norm_and_project`` folds the norm before this layer (and SiLU after
        it) into its one-row GEMV for ``x`` (``plugins.models.fused_gemv``)."""
        return (
            self.fused is not None
            and self.kernel is None
            and not self._reduce
            and x.dim() == 2
            and x.shape[0] == 1
            and x.stride(1) == 1
            and fused_offered()
        )

    def slots(self, names: Sequence[str]) -> Slots:
        """Checkpoint names (without ``.weight``) of each merged part, in row order."""
        result: Slots = {}
        start = 0
        parts = zip(names, self.part_ranges, self.full_output_sizes, strict=True)
        for name, (begin, end), full in parts:
            size = end - begin
            if self.parallel == "row" and self._reduce:
                lo, hi = self.in_range
                result[f"{name}.weight"] = WeightSlot(
                    self.weight, start, start + size, (1, lo, hi), self.full_in_features, self
                )
                if self.bias is not None:
                    result[f"{name}.bias"] = WeightSlot(self.bias, start, start + size)
            else:
                sharded = (begin, end) != (0, full)
                source = (0, begin, end) if sharded else None
                result[f"{name}.weight"] = WeightSlot(
                    self.weight, start, start + size, source, full if sharded else None, self
                )
                if self.bias is not None:
                    result[f"{name}.bias"] = WeightSlot(
                        self.bias, start, start + size, source, full if sharded else None
                    )
            start += size
        return result if self.slot_hook is None else self.slot_hook(self, result)


class Embedding(nn.Module):
    """Token embedding ``[vocab, dim]``, also the LM head's weight (tied or not).

    Vocab-parallel in a group of more than one rank: the vocabulary is padded to a
    multiple of the group size and each rank holds the rows ``vocab_range`` of it
    (padding rows are zero and never read from the checkpoint). ``forward`` looks up
    the ids this rank holds, zeroes the others' and all-reduces; ``logits`` computes
    this rank's vocab columns and all-gathers them, so every rank holds the full
    logits ``[N, num_embeddings]`` (the padding columns are cut off, never sampled).
    """

    # Set by a weight quant method under ``quant_lm_head``: the LM head's projection from
    # its quantized copy of this rank's rows (``quantize_lm_head``); with
    # ``lookups_from_kernel`` (tied, int8) the lookups read it too, the 16-bit table gone.
    logits_kernel: LinearKernel | None = None
    lookups_from_kernel: bool = False
    # The one-row GEMV's config for the LM head (``skinny_gemm.gemv``), where it measured
    # faster than cuBLAS at one row: batch-1 decode's logits.
    gemv: tuple[int, int, int] | None = None

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        group = self.group = parallel_state.current()
        self.num_embeddings = num_embeddings
        padded = -(-num_embeddings // group.size) * group.size
        self.vocab_range = parallel_state.even_range(padded, group.size, group.rank)
        start, stop = self.vocab_range
        self.num_real_rows = max(0, min(stop, num_embeddings) - start)  # the rest pad
        self.weight = nn.Parameter(torch.empty(stop - start, dim, dtype=dtype), False)
        self.weight.data[self.num_real_rows :].zero_()
        self._sharded = group.size > 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab_range
        outside = (ids < start) | (ids >= stop) if self._sharded else None
        local = ids if outside is None else torch.where(outside, 0, ids - start)
        if self.lookups_from_kernel:  # the int8 head's rows (LinearKernel.rows)
            hidden = self.logits_kernel.rows(local, self.weight.dtype)  # type: ignore[union-attr]
        else:
            hidden = F.embedding(local, self.weight)
        if outside is None:
            return hidden
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, dim] -> logits [N, num_embeddings] in the model dtype (through the
        quantized copy when ``logits_kernel`` is set: ``quant_lm_head``)."""
        if self.logits_kernel is not None:
            logits = self.logits_kernel.apply(hidden, None)
        elif self.gemv is not None and hidden.shape[0] == 1 and hidden.stride(1) == 1:
            from tokenloom.plugins.models.skinny_gemm import gemv

            logits = gemv(hidden, self.weight, self.gemv)
        else:
            logits = F.linear(hidden, self.weight)
        if not self._sharded:
            return logits
        gathered = self.group.all_gather(logits, dim=-1)  # [N, padded vocab]
        return gathered[:, : self.num_embeddings]

    def slot(self) -> WeightSlot:
        """Where the checkpoint's ``[vocab, dim]`` tensor goes: this rank's rows."""
        if not self._sharded:
            return whole(self.weight)
        start = self.vocab_range[0]
        stop = start + self.num_real_rows
        return WeightSlot(self.weight, 0, self.num_real_rows, (0, start, stop), self.num_embeddings)


def fused(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the fused Triton kernels of ``fused_ops`` / ``rope_ops``: on a
    GPU, with no gradient recorded. Those kernels write outputs autograd does not see,
    so where gradients are recorded (a calibration's learned rounding and scale tuning
    on a GPU: ``tokenloom quantize --device cuda``) the reference ops run; the engine
    runs in inference mode, which records none."""
    return x.is_cuda and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, weight applied in the model dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)

    def forward(self, x: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)``; with ``order`` its columns gathered, ``norm(x)[..., order]`` (for
        a projection that keeps its inputs in that order: ``Linear.input_order``)."""
        if fused(x) and x.dim() == 2:
            from tokenloom.plugins.models import fused_ops

            normed = fused_ops.add_rms_norm(x, self.weight, self.eps, order=order)[0]
            assert isinstance(normed, torch.Tensor)
            return normed
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)
        return y if order is None else y.index_select(-1, order)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual stream in one pass (the
        norm's columns in ``order``, as ``forward``)."""
        if fused(x):
            from tokenloom.plugins.models import fused_ops

            normed, summed = fused_ops.add_rms_norm(x, self.weight, self.eps, residual, order=order)
            assert isinstance(normed, torch.Tensor)
            return normed, summed
        summed = x + residual
        return self.forward(summed, order), summed

    def add_and_norm_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[Fp8Rows, torch.Tensor]:
        """``add_and_norm`` (a None residual: ``norm(x), x``) with the norm quantized per
        token in the same kernel (CUDA, 2-D ``x``): for a projection that
        ``takes_fp8_rows``."""
        from tokenloom.plugins.models import fused_ops
        from tokenloom.protocols.components.quant import Fp8Rows

        normed, summed = fused_ops.add_rms_norm(x, self.weight, self.eps, residual, fp8=True)
        assert isinstance(normed, Fp8Rows)
        return normed, summed


def silu_and_mul(gate_up: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``order`` its columns gathered (``fused_ops.silu_and_mul``)."""
    if fused(gate_up):
        from tokenloom.plugins.models import fused_ops

        return fused_ops.silu_and_mul(gate_up, order)
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return y if order is None else y.index_select(-1, order)
