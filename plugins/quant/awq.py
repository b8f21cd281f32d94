"""AWQ: activation-aware scaling of a decoder layer's input channels before its
weights are rounded (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for
LLM Compression and Acceleration"; written here from the paper).

A ``Linear`` computes ``y = x W^T``. For any positive ``s [K]``,
``y = (x / s) (W diag(s))^T``: scaling input channel ``j``'s weight column up by
``s_j`` and its input down by the same factor changes nothing in float. Rounded to a
grid, the columns scaled up lose relatively less, and the input channels that carry
the most (large ``|x_j|``, the "salient" ones) should be the ones protected. AWQ takes
``s_j = mean |x_j| ^ alpha`` over the calibration tokens, with ``alpha`` searched on
the grid 0, 0.05, ..., 1 per group of linears that read one input, minimizing the
output error of the rounded, scaled layer against the float one on the calibration
inputs: ``tr(D H D^T)``, ``D = W - Q(W diag(s)) diag(1 / s)``, ``H = X^T X``.
``alpha = 0`` is plain round-to-nearest, so the search never does worse than RTN on
its own objective. ``s`` is divided by ``sqrt(max s * min s)`` (centred on 1 in
log scale); a common factor does not change the int4 rounding of a group.

``1 / s`` is folded into whatever produces ``x``, so no new operation runs:

- q/k/v (merged ``qkv_proj``): into ``input_layernorm.weight``;
- gate/up (merged ``gate_up_proj``): into ``post_attention_layernorm.weight``;
- ``down_proj``: into ``up_proj``'s rows (``x = silu(gate) * up``, so scaling up's
  output ``j`` by ``1 / s_j`` scales ``x_j`` by it);
- ``o_proj``: into ``v_proj``'s rows (and bias). Its input channel ``h D + d`` is
  dimension ``d`` of query head ``h``'s attention output, a mix of rows of the value
  head ``g = h // (Hq / Hkv)``: with grouped-query attention one value row feeds
  ``Hq / Hkv`` input channels, so those channels share one scale (from their mean
  ``|x|``), which makes the fold exact.

``down_proj`` and ``o_proj`` are searched first, so that up and v are already folded
when gate/up and q/k/v are searched on them. Every statistic comes from one float
forward of the layer (the inputs of the layers before it already quantized, as in the
sequential GPTQ pass); folding leaves that forward unchanged.

Optionally (``AwqScaler.clip_group``) AWQ's second step follows each scaling: every
row's groups clamped to the fraction of their range that rounds with the least
output error (``search_clip``); on the built-in model it raised the perplexity.

The grid is int4 ``Int4Grid`` (asymmetric groups, fitted on the whole weight: the RTN
of ``int4.py``). Built for the Llama-family layers of ``plugins.models.llama``
(Llama, Mistral, Qwen2/3), unsharded (tensor parallel size 1), on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenloom.logging import get_logger
from tokenloom.plugins.models.layers import Linear, RMSNorm
from tokenloom.plugins.quant.gptq import Int4Grid

log = get_logger(__name__)

ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1
CLIP_RATIOS = tuple(1 - i / 20 for i in range(10))  # 1, 0.95, ..., 0.55
MIN_MAGNITUDE = 1e-5  # of the largest mean |x|: floor for channels that never fire

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # W [N, K] -> rounded W, float32


def int4_rtn(group: int) -> Quantizer:
    """Round-to-nearest onto ``Int4Grid(group)`` (every group fitted on ``w``), the
    values ``Int4Grid.round`` gives column by column, computed at once."""

    def quantize(w: torch.Tensor) -> torch.Tensor:
        grid = Int4Grid(group, static=True)
        grid.start(w)  # fits every group's scale and zero point
        k = w.shape[1]
        scale = torch.stack(grid.scales, dim=1).repeat_interleave(group, dim=1)[:, :k]
        zero = torch.stack(grid.zeros, dim=1).repeat_interleave(group, dim=1)[:, :k]
        q = (torch.round(w / scale) + zero).clamp(0, 15)
        return (q - zero) * scale

    return quantize


def search_clip(
    w: torch.Tensor,
    h: torch.Tensor,
    quantize: Quantizer,
    group: int,
    ratios: tuple[float, ...] = CLIP_RATIOS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's second step: ``w [N, K]`` with each group of ``group`` inputs of each
    row clamped to ``ratio`` times its range (so the grid fitted on it is that much
    finer), the ratio chosen per row and group among ``ratios`` by the group's own
    share of the rounded output error, ``d_g H_gg d_g^T`` (``h [K, K]`` the inputs'
    ``X^T X``; the cross terms between groups are left out, as in the paper).
    Returns the clamped weight and the ratios ``[N, ceil(K / group)]``."""
    w = w.float()
    n, k = w.shape
    groups = -(-k // group)
    pad = groups * group - k  # the last group may be short (k = 576 in groups of 128)
    hp = torch.nn.functional.pad(h.float(), (0, pad, 0, pad))
    blocks = torch.stack([hp[g : g + group, g : g + group] for g in range(0, k + pad, group)])
    wg = torch.nn.functional.pad(w, (0, pad)).view(n, groups, group)
    lo = wg.amin(dim=2, keepdim=True).clamp(max=0.0)  # the zero padding changes neither
    hi = wg.amax(dim=2, keepdim=True).clamp(min=0.0)

    def clamp(ratio: torch.Tensor | float) -> torch.Tensor:
        return torch.maximum(torch.minimum(wg, hi * ratio), lo * ratio).reshape(n, -1)[:, :k]

    best_error = torch.full((n, groups), float("inf"), device=w.device)
    best_ratio = torch.ones(n, groups, device=w.device)
    for ratio in ratios:
        d = torch.nn.functional.pad(w - quantize(clamp(ratio)), (0, pad)).view(n, groups, group)
        error = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return clamp(best_ratio[:, :, None]), best_ratio


@dataclass
class InputStats:
    """Of one ``Linear``'s calibration inputs: ``sum |x_j|``, ``sum x x^T`` and the
    token count (float64 sums)."""

    abs_sum: torch.Tensor
    xtx: torch.Tensor
    tokens: int = 0

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()

    def h(self) -> torch.Tensor:
        """``X^T X / T`` in float32 (the error metric; a common factor is harmless)."""
        return (self.xtx / max(self.tokens, 1)).float()


def search_scale(
    w: torch.Tensor,
    stats: InputStats,
    quantize: Quantizer,
    tie: torch.Tensor | None = None,
    alphas: tuple[float, ...] = ALPHAS,
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """The per-input-channel scale ``s [K]`` minimizing the rounded output error of
    ``w [N, K]`` on ``stats``, its ``alpha``, and the error of each ``alpha``.

    ``tie [K]`` (optional): channels with the same label share one scale, from their
    mean ``|x|`` (the value rows of grouped-query attention)."""
    w = w.float()
    magnitude = stats.mean_abs()
    if tie is not None:
        sums = torch.zeros(int(tie.max()) + 1, device=tie.device).index_add_(0, tie, magnitude)
        counts = torch.zeros_like(sums).index_add_(0, tie, torch.ones_like(magnitude))
        magnitude = (sums / counts)[tie]
    magnitude = magnitude.clamp(min=float(magnitude.max()) * MIN_MAGNITUDE + 1e-30)
    h = stats.h()
    errors: dict[float, float] = {}
    best: tuple[float, float, torch.Tensor] | None = None
    for alpha in alphas:
        s = magnitude.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        d = w - quantize(w * s) / s
        error = float(((d @ h) * d).sum())
        errors[alpha] = error
        if best is None or error < best[0]:
            best = (error, alpha, s)
    assert best is not None
    return best[2], best[1], errors


def _capture_stats(
    linears: dict[str, Linear],
    run: Callable[[], None],
) -> dict[str, InputStats]:
    """The input statistics of each of ``linears`` over the forwards ``run`` makes."""
    stats = {
        name: InputStats(
            torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device),
            torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=m.weight.device),
        )
        for name, m in linears.items()
    }

    def hook_for(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, module.in_features).float()
            entry = stats[name]
            entry.abs_sum.add_(x.abs().sum(dim=0).double())
            entry.xtx.add_((x.t() @ x).double())
            entry.tokens += x.shape[0]

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears.items()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return stats


# module names (inside a decoder layer) of the linears AWQ scales, in search order
LINEARS = ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")


@dataclass
class AwqScaler:
    """The per-layer step of ``calibration.quantize_sequentially`` (``prepare_layer``):
    searches and folds the four scales of one Llama-family decoder layer in place,
    before its linears are rounded. ``alphas`` records the chosen ``alpha`` and
    ``gains`` the searched error as a fraction of RTN's (``alpha = 0``), by the
    linear's full name. ``clip_group``: AWQ's clipping search too (``clips``)."""

    quantize: Quantizer
    grid: tuple[float, ...] = ALPHAS  # the alphas tried
    clip_group: int = 0  # > 0: then clip each scaled weight (``search_clip``) per group
    alphas: dict[str, float] = field(default_factory=dict)
    gains: dict[str, float] = field(default_factory=dict)
    clips: dict[str, float] = field(default_factory=dict)  # the mean clip ratio

    @torch.no_grad()
    def __call__(self, index: int, layer: nn.Module, run: Callable[[], None]) -> None:
        """``run()`` makes the layer's float forward over every calibration sequence."""
        attn, mlp = layer.self_attn, layer.mlp
        linears: dict[str, Linear] = {name: layer.get_submodule(name) for name in LINEARS}
        stats = _capture_stats(linears, run)

        def search(name: str, tie: torch.Tensor | None = None) -> torch.Tensor:
            s, alpha, errors = search_scale(
                linears[name].weight.data, stats[name], self.quantize, tie, self.grid
            )
            key = f"model.layers.{index}.{name}"
            self.alphas[key] = alpha
            rtn = errors.get(0.0, 0.0)
            self.gains[key] = errors[alpha] / rtn if rtn > 0 else 1.0
            return s

        def scale(name: str, s: torch.Tensor) -> None:
            linear = linears[name]
            scale_columns(linear, s)
            if self.clip_group:
                h = stats[name].h() / s[:, None] / s[None, :]  # of the inputs x / s
                clipped, ratios = search_clip(linear.weight.data, h, self.quantize, self.clip_group)
                linear.weight.data.copy_(clipped)
                self.clips[f"model.layers.{index}.{name}"] = float(ratios.mean())

        s = search("mlp.down_proj")
        fold_into_rows(mlp.gate_up_proj, mlp.down_proj.in_features, s)  # up_proj's rows
        scale("mlp.down_proj", s)
        s = search("mlp.gate_up_proj")
        fold_into_norm(layer.post_attention_layernorm, s)
        scale("mlp.gate_up_proj", s)

        device = attn.o_proj.weight.device
        tie = value_rows_of_o_inputs(attn.num_heads, attn.num_kv_heads, attn.head_dim, device)
        s = search("self_attn.o_proj", tie)
        v_scale = torch.ones(attn.kv_size, device=s.device).index_copy_(0, tie, s)  # a value row
        fold_into_rows(attn.qkv_proj, attn.q_size + attn.kv_size, v_scale)
        scale("self_attn.o_proj", s)
        s = search("self_attn.qkv_proj")
        fold_into_norm(layer.input_layernorm, s)
        scale("self_attn.qkv_proj", s)
        chosen = (
            f"{n.rsplit('.', 1)[1]} {self.alphas[f'model.layers.{index}.{n}']:.2f}" for n in LINEARS
        )
        log.info("AWQ: layer %d, alpha: %s", index, ", ".join(chosen))


def value_rows_of_o_inputs(
    num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[num_heads * head_dim]``: the value row (``g * head_dim + d``) each input
    channel ``h * head_dim + d`` of ``o_proj`` reads, ``g = h // (num_heads /
    num_kv_heads)`` (grouped-query attention repeats each value head)."""
    group = num_heads // num_kv_heads
    heads = torch.arange(num_heads, device=device).repeat_interleave(head_dim) // group
    return heads * head_dim + torch.arange(head_dim, device=device).repeat(num_heads)


def scale_columns(linear: Linear, s: torch.Tensor) -> None:
    """``W[:, j] *= s_j``."""
    linear.weight.data.mul_(s.to(linear.weight.dtype)[None, :])


def fold_into_rows(linear: Linear, first: int, s: torch.Tensor) -> None:
    """Rows ``first .. first + len(s)`` of ``linear`` (weight and bias) divided by
    ``s``: its outputs there come out ``1 / s`` times as large."""
    rows = slice(first, first + s.shape[0])
    linear.weight.data[rows].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias.data[rows].div_(s.to(linear.bias.dtype))


def fold_into_norm(norm: RMSNorm, s: torch.Tensor) -> None:
    """The norm's output channel ``j`` divided by ``s_j``."""
    norm.weight.data.div_(s.to(norm.weight.dtype))


__all__ = [
    "ALPHAS",
    "AwqScaler",
    "InputStats",
    "LINEARS",
    "fold_into_norm",
    "fold_into_rows",
    "int4_rtn",
    "scale_columns",
    "search_clip",
    "search_scale",
    "value_rows_of_o_inputs",
]
