"""GPTQ: calibrated, error-compensating rounding of one weight matrix onto a grid.

Round-to-nearest (RTN) rounds each weight on its own. GPTQ (Frantar et al. 2022,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers")
rounds the columns (input channels) of ``W [N, K]`` one at a time and, after each,
moves the columns not yet rounded so that the layer's output on the calibration
inputs ``X`` changes as little as possible: it minimizes ``|| X W^T - X Q^T ||^2``
column by column, with ``H = X^T X`` (up to a factor) as the metric. The update of
the remaining columns after rounding column ``j`` with error ``e`` is
``-e / [H^-1]_jj * [H^-1]_j,>j``; using the upper Cholesky factor ``U`` of ``H^-1``
(``H^-1 = U^T U``) gives these rows directly, without re-inverting as columns go.
The updates are applied lazily: inside a block of columns at once, to the columns
after the block in one matrix product.

The grid is pluggable (``Grid``): ``Int4Grid`` (asymmetric, a scale and an integer
zero point per group of input rows, the GPTQ checkpoint layout) and ``Fp8Grid``
(e4m3 with one scale per output row). Everything runs in float32 (``H`` in float64
for the Cholesky factorizations), on whatever device the tensors are on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenloom.plugins.quant.fp8 import FP8, FP8_MAX
from tokenloom.plugins.quant.int4_pack import pack_int4

DAMPING = 0.01  # fraction of the mean diagonal of H added to it (H is often singular)
BLOCK = 128  # columns per lazy update


class Grid(ABC):
    """The values one weight may take, and a record of the codes chosen."""

    group: int = 0  # columns sharing parameters fitted as GPTQ reaches them; 0: none
    static: bool = True  # parameters fixed by ``start`` (act-order needs this)

    @abstractmethod
    def start(self, w: torch.Tensor) -> None:
        """Called once with the whole weight ``[N, K]`` before any column is rounded."""

    def fit(self, first: int, columns: torch.Tensor) -> None:
        """Fit the parameters of the group starting at column ``first`` on its
        current (error-updated) ``columns [N, <= group]``; grids with ``group > 0``."""
        raise NotImplementedError(f"{type(self).__name__} has no groups")

    @abstractmethod
    def round(self, column: torch.Tensor, index: int) -> torch.Tensor:
        """Column ``index`` ``[N]`` rounded to the grid, as float32 values; records
        the code so that the result can be stored."""


class Int4Grid(Grid):
    """4-bit, asymmetric, per group of ``group`` input rows: ``w = (q - z) * s`` with
    ``q`` and ``z`` integers in 0..15, ``s`` float16 (as GPTQ checkpoints store it).

    The group's range is widened to hold 0 (as RTN in ``int4.py``); the zero point
    is kept in 1..15, so that the classic GPTQ format, which stores ``z - 1`` in four
    bits, holds every value: a group with no negative weight uses ``s = max / 14``.

    ``static``: every group's parameters are fitted on the weight before GPTQ moves
    it (needed for act-order, which visits the columns out of order; the groups stay
    ``k // group``, so the checkpoint needs no permutation); otherwise each group is
    fitted when GPTQ reaches its first column, on the values moved so far."""

    def __init__(self, group: int, static: bool = False) -> None:
        self.group = group
        self.static = static
        self.scales: list[torch.Tensor] = []  # per group [N] float32 (fp16 values)
        self.zeros: list[torch.Tensor] = []  # per group [N] float32 integers
        self.codes: torch.Tensor | None = None  # [N, K] uint8 (a byte a weight)
        # learned rounding's weights and offsets, (w, v) [N, K] float32, with codes =
        # clamp(round(w / s + v) + z, 0, 15) at the rounding's scales: what
        # ``scale_tuning.tune_scales(codes=...)`` trains (``learn_layers(keep_latent=True)``)
        self.latent: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, w: torch.Tensor) -> None:
        self.codes = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
        if self.static:
            for first in range(0, w.shape[1], self.group):
                self.fit(first, w[:, first : first + self.group])

    def fit(self, first: int, columns: torch.Tensor) -> None:
        lo = columns.amin(dim=1).clamp(max=0.0)
        hi = columns.amax(dim=1).clamp(min=0.0)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        zero = torch.round(-lo / scale)
        low_zero = zero < 1  # -lo < s / 2: shift the grid one step down, keep hi on it
        scale = torch.where(low_zero, (hi / 14).clamp(min=1e-6), scale)
        zero = torch.where(low_zero, torch.ones_like(zero), zero)
        self.scales.append(scale.half().float())  # rounded as stored
        self.zeros.append(zero)

    def round(self, column: torch.Tensor, index: int) -> torch.Tensor:
        assert self.codes is not None
        scale, zero = self.scales[index // self.group], self.zeros[index // self.group]
        q = (torch.round(column / scale) + zero).clamp(0, 15)
        self.codes[:, index] = q.to(torch.uint8)
        return (q - zero) * scale

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qweight [K / 8, N] int32, scales [G, N] float16, zeros [G, N] int32)``."""
        assert self.codes is not None
        scales = torch.stack(self.scales).half()
        zeros = torch.stack(self.zeros).to(torch.int32)
        return pack_int4(self.codes.t().contiguous()), scales, zeros


class Fp8Grid(Grid):
    """e4m3 with one float32 scale per output row, ``max |w_row| / 448`` of the
    weight before GPTQ moves it (values pushed past the range saturate at 448)."""

    def __init__(self) -> None:
        self.scales: torch.Tensor | None = None  # [N, 1] float32
        self.codes: torch.Tensor | None = None  # [N, K] e4m3

    def start(self, w: torch.Tensor) -> None:
        amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        self.scales = amax / torch.full_like(amax, FP8_MAX)  # as fp8.quantize_fp8_rows
        self.codes = torch.empty(w.shape, dtype=FP8, device=w.device)

    def round(self, column: torch.Tensor, index: int) -> torch.Tensor:
        assert self.scales is not None and self.codes is not None
        scale = self.scales[:, 0]
        q = (column / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.codes[:, index] = q
        return q.float() * scale


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    grid: Grid,
    damping: float = DAMPING,
    block: int = BLOCK,
    act_order: bool = False,
) -> torch.Tensor:
    """Round ``w [N, K]`` onto ``grid`` minimizing the output error under ``h [K, K]``
    (the inputs' ``X^T X``, any positive factor); returns the rounded weight
    (float32, ``[N, K]``); the codes are in ``grid``. Columns whose input is always
    zero (``h_jj = 0``) are set to 0 first: no input reaches them.

    ``act_order``: visit the columns by decreasing ``h_jj`` (the inputs with the most
    energy first, while many columns are left to absorb their error); the grid must
    be ``static``."""
    w = w.detach().float().clone()
    h = h.detach().double().clone()
    n, k = w.shape
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grid.start(w)  # in the natural column order: groups are k // group
    order = torch.arange(k, device=w.device)
    if act_order:
        if not grid.static:
            raise ValueError("act_order needs a static grid")
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    elif grid.group:
        block = max(grid.group, block // grid.group * grid.group)  # groups start in a block
    h.diagonal().add_(damping * torch.diagonal(h).mean())
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(h_inv, upper=True).float()  # H^-1 = U^T U
    dynamic = grid.group and not grid.static
    rounded = torch.empty_like(w)
    columns = order.tolist()  # once: not a device sync a column
    for first in range(0, k, block):
        last = min(first + block, k)
        chunk = w[:, first:last].clone()
        errors = torch.empty_like(chunk)
        u_chunk = u[first:last, first:last]
        for i in range(last - first):
            column = first + i
            if dynamic and column % grid.group == 0:
                grid.fit(column, chunk[:, i : i + grid.group])
            q = grid.round(chunk[:, i], columns[column])
            rounded[:, column] = q
            error = (chunk[:, i] - q) / u_chunk[i, i]
            chunk[:, i + 1 :] -= error[:, None] * u_chunk[i, i + 1 :][None, :]
            errors[:, i] = error
        w[:, last:] -= errors @ u[first:last, last:]
    return rounded[:, torch.argsort(order)]


def output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the squared output error on the inputs of ``h``."""
    d = (w.float() - q.float()).double()
    return float(torch.einsum("nk,kl,nl->", d, h.double(), d))


__all__ = ["BLOCK", "DAMPING", "Fp8Grid", "Grid", "Int4Grid", "gptq", "output_error"]
