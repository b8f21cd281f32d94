"""Learned rounding: each decoder layer's weights rounded to reproduce the layer's
output, by signed gradient descent (SignRound; Cheng et al. 2023, "Optimize Weight
Rounding via Signed Gradient Descent for the Quantization of LLMs"; written here from
the paper).

GPTQ and AWQ minimize each ``Linear``'s own output error, one at a time. Here the
objective is the whole decoder layer's output (attention, SiLU and the residual
stream included): every weight gets a learned offset ``v`` in ``[-1/2, 1/2]`` of its
grid step before rounding, ``q = round(w / s + v)``, which can only choose between
the two grid points around ``w``; for int4 each group's range is also shrunk by
learned factors in ``[1/2, 1]`` of its minimum and maximum. The rounding passes
gradients straight through (``round_ste``); the step is ``lr * sign(grad)``, ``lr``
decaying linearly from ``1 / iters`` to 0, so no offset can move further than the
interval it lives in. The loss is the mean squared error of the layer's output stream
(``mlp out + residual``) against the float model's.

- **int4** (``Int4Rounding``): the grid of ``gptq.Int4Grid`` (asymmetric groups,
  range widened to hold 0, zero point in 1..15, float16 scales), so the result is a
  ``Int4Grid`` the GPTQ checkpoint writer stores as is.
- **fp8** (``Fp8Rounding``): e4m3 with one scale per output row (``max |w_row| /
  448``, fixed); the offset is in units of each weight's own e4m3 step. The layer's
  inputs to every ``Linear`` are rounded per token as the W8A8 kernels round them
  (straight through), so the weights learn around the activations' rounding too.

``learn_layers`` runs the layers in turn: inputs from the layers before, already
rounded (the quantized model's stream), targets from the float model's own stream
(``target="float"``, as SignRound) or from the float layer on the quantized stream
(``"local"``). Sequences of one length are packed ``batch`` at a time into one
forward (``PackedAttention``). Built for the Llama-family layers, on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tokenloom.logging import get_logger
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.calibration import model_device
from tokenloom.plugins.quant.fp8 import FP8, FP8_MAX, quantize_fp8_rows
from tokenloom.plugins.quant.gptq import Fp8Grid, Grid, Int4Grid
from tokenloom.protocols.components.attention import ForwardContext

log = get_logger(__name__)

MIN_CLIP = 0.5  # int4: a group's range may shrink to half at each end, no further


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


class Int4Rounding(nn.Module):
    """``w [N, K]`` rounded onto ``Int4Grid(group)``'s grid with learned offsets and
    range factors; ``forward()`` gives the rounded weight (float32)."""

    def __init__(self, w: torch.Tensor, group: int) -> None:
        super().__init__()
        n, k = w.shape
        self.group, self.k = group, k
        groups = -(-k // group)
        padded = F.pad(w.float(), (0, groups * group - k))  # zeros: the range holds 0 anyway
        self.register_buffer("w", padded.view(n, groups, group))
        self.v = nn.Parameter(torch.zeros_like(self.w))
        self.lo_clip = nn.Parameter(torch.ones(n, groups, 1, device=w.device))
        self.hi_clip = nn.Parameter(torch.ones(n, groups, 1, device=w.device))

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, scale, zero)`` as float32 (codes with gradients)."""
        lo = self.w.amin(dim=2, keepdim=True).clamp(max=0.0) * self.lo_clip
        hi = self.w.amax(dim=2, keepdim=True).clamp(min=0.0) * self.hi_clip
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        zero = round_ste(-lo / scale)
        low_zero = zero.detach() < 1  # as Int4Grid.fit: shift the grid, keep hi on it
        scale = torch.where(low_zero, (hi / 14).clamp(min=1e-6), scale)
        zero = torch.where(low_zero, torch.ones_like(zero), zero)
        scale = scale + (scale.half().float() - scale).detach()  # stored as float16
        codes = (round_ste(self.w / scale + self.v) + zero).clamp(0, 15)
        return codes, scale, zero

    def forward(self) -> torch.Tensor:
        codes, scale, zero = self._grid()
        return ((codes - zero) * scale).flatten(1)[:, : self.k]

    def clamp_(self) -> None:
        self.v.data.clamp_(-0.5, 0.5)
        for clip in (self.lo_clip, self.hi_clip):
            clip.data.clamp_(MIN_CLIP, 1.0)

    @torch.no_grad()
    def grid(self, latent: bool = False) -> Int4Grid:
        """The rounded grid; ``latent``: with the weights and offsets that give its codes
        (``Int4Grid.latent``, 8 bytes a weight: only for ``tune_scales(codes=...)``)."""
        codes, scale, zero = self._grid()
        grid = Int4Grid(self.group, static=True)
        grid.scales = list(scale[:, :, 0].t().contiguous())
        grid.zeros = list(zero[:, :, 0].t().contiguous())
        grid.codes = codes.flatten(1)[:, : self.k].to(torch.uint8)
        if latent:
            grid.latent = (
                self.w.flatten(1)[:, : self.k].clone(),
                self.v.detach().flatten(1)[:, : self.k].clone(),
            )
        return grid


class Fp8Rounding(nn.Module):
    """``w [N, K]`` rounded to e4m3 with one scale per row and learned offsets."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        self.register_buffer("scale", amax / torch.full_like(amax, FP8_MAX))
        unit = w.float() / self.scale
        _, exponent = torch.frexp(unit.abs().clamp(min=2.0**-6))  # subnormals: 2^-9 steps
        self.register_buffer("unit", unit)
        self.register_buffer("step", torch.ldexp(torch.ones_like(unit), exponent - 4))
        self.v = nn.Parameter(torch.zeros_like(unit))

    def codes(self) -> torch.Tensor:
        steps = round_ste(self.unit / self.step + self.v)
        return (steps * self.step).clamp(-FP8_MAX, FP8_MAX)

    def forward(self) -> torch.Tensor:
        return self.codes() * self.scale

    def clamp_(self) -> None:
        self.v.data.clamp_(-0.5, 0.5)

    @torch.no_grad()
    def grid(self) -> Fp8Grid:
        grid = Fp8Grid()
        grid.scales = self.scale.clone()
        grid.codes = self.codes().to(FP8)  # on the grid already: exact
        return grid


class PackedAttention:
    """``ctx.attn`` for ``batch`` sequences of ``length`` tokens packed one after the
    other: causal attention inside each sequence."""

    accepts_written_kv = False
    accepts_rope = False  # the model rotates q and k (on a GPU too)

    def __init__(self, length: int) -> None:
        self.length = length

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, **_):  # type: ignore[no-untyped-def]
        t, heads, dim = q.shape
        group = heads // k.shape[1]

        def split(x: torch.Tensor) -> torch.Tensor:  # [B*L, H, D] -> [B, H, L, D]
            return x.view(t // self.length, self.length, x.shape[1], dim).transpose(1, 2)

        k, v = (split(x).repeat_interleave(group, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(split(q), k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(t, heads, dim)


def packed_context(model: nn.Module, length: int) -> ForwardContext:
    """A forward context for ``model`` over sequences of ``length`` tokens packed one
    after the other (``PackedAttention``; no KV cache)."""
    return ForwardContext(
        attn=PackedAttention(length),  # type: ignore[arg-type]
        meta=None,  # type: ignore[arg-type]
        kv_caches=[(torch.empty(0), torch.empty(0))] * len(model.model.layers),
    )


def round_activations(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """A forward pre-hook: the input rounded per token as the W8A8 kernels do, with
    gradients straight through."""
    x = args[0]
    xq, scales = quantize_fp8_rows(x.detach().reshape(-1, x.shape[-1]))
    rounded = (xq.float() * scales).view_as(x).to(x.dtype)
    return (x + (rounded - x).detach(),)


Stream = tuple[torch.Tensor, torch.Tensor | None]  # (hidden, residual) before a layer


def learn_layers(
    model: nn.Module,
    sequences: list[list[int]],
    method: Literal["int4", "fp8"],
    group: int = 128,
    iters: int = 200,
    batch: int = 4,
    target: Literal["float", "local"] = "float",
    prepare_layer: Callable[[int, nn.Module, Callable[[], None]], None] | None = None,
    record: dict[str, tuple[float, float]] | None = None,
    per_token: bool = False,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_tokens: int = 256,
    keep_latent: bool = False,
) -> dict[str, Grid]:
    """Round every ``Linear`` of ``model.model.layers`` in place by learned rounding
    (their ``weight`` then holds the rounded values); returns each one's grid by
    module name. ``sequences`` must share one length. ``prepare_layer`` as in
    ``calibration.quantize_sequentially`` (e.g. AWQ's scaling), on the quantized
    stream. ``record``: each layer's mean output error, rounded to nearest and learned (over
    16 evenly spaced packs).
    ``per_token``: each token's error relative to its target's mean square (the final
    norm's view), so that a few huge tokens (the attention sink's) do not outweigh the
    rest. ``head`` (the final norm and LM head: stream -> logits): the last layer is
    fitted to the float model's next-token distribution instead (the KL divergence,
    on ``head_tokens`` evenly spaced tokens of each pack), what the perplexity
    measures. ``keep_latent``: int4 grids keep their weights and offsets
    (``Int4Grid.latent``), for ``scale_tuning.tune_scales(codes=...)``."""
    length = len(sequences[0])
    if any(len(s) != length for s in sequences):
        raise ValueError("learned rounding packs sequences of one length")
    inner = model.model
    ctx = packed_context(model, length)
    packs = [sequences[i : i + batch] for i in range(0, len(sequences), batch)]
    ropes, quant, fp = [], [], []
    device = model_device(model)
    with torch.no_grad():
        for pack in packs:
            ids = torch.tensor([t for s in pack for t in s], dtype=torch.long, device=device)
            ropes.append(inner.rotary(torch.arange(length, device=device).repeat(len(pack))))
            hidden = inner.embed_tokens(ids).float()
            quant.append((hidden, None))
            fp.append((hidden, None))
    grids: dict[str, Grid] = {}
    shown = sorted({round(i * (len(packs) - 1) / 15) for i in range(16)})  # for the record
    model.requires_grad_(False)  # gradients for the rounding parameters only
    for index, layer in enumerate(inner.layers):
        error = _error_fn(per_token, head if index == len(inner.layers) - 1 else None, head_tokens)
        with torch.no_grad():
            targets = []
            for i in range(len(packs)):
                h, r = layer(ropes[i], *(fp[i] if target == "float" else quant[i]), ctx)
                targets.append(h + r)
                if target == "float":
                    fp[i] = (h, r)
            if prepare_layer is not None:
                prepare_layer(index, layer, lambda layer=layer: _run(layer, ropes, quant, ctx))
        names = [n for n, m in layer.named_modules() if isinstance(m, Linear)]
        linears: dict[str, Linear] = {n: layer.get_submodule(n) for n in names}
        rounders: dict[str, Int4Rounding | Fp8Rounding] = {
            n: Int4Rounding(m.weight.data, group)
            if method == "int4"
            else Fp8Rounding(m.weight.data)
            for n, m in linears.items()
        }
        hooks = (
            [m.register_forward_pre_hook(round_activations) for m in linears.values()]
            if method == "fp8"
            else []
        )
        try:
            before = _mean_loss(layer, rounders, ropes, quant, targets, ctx, error, shown)
            params = [p for r in rounders.values() for p in r.parameters()]
            for step in range(iters):
                i = step % len(packs)
                weights = {f"{n}.weight": r() for n, r in rounders.items()}
                h, r = functional_call(layer, weights, (ropes[i], *quant[i], ctx))
                loss = error(h + r, targets[i])
                for p in params:
                    p.grad = None
                loss.backward()
                lr = (1 - step / iters) / iters
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.sub_(lr * torch.sign(p.grad))
                    for rounder in rounders.values():
                        rounder.clamp_()
            after = _mean_loss(layer, rounders, ropes, quant, targets, ctx, error, shown)
            with torch.no_grad():
                for n, rounder in rounders.items():
                    linears[n].weight.data.copy_(rounder())
                    grids[f"model.layers.{index}.{n}"] = (
                        rounder.grid(keep_latent)
                        if isinstance(rounder, Int4Rounding)
                        else rounder.grid()
                    )
                for i in range(len(packs)):
                    quant[i] = layer(ropes[i], *quant[i], ctx)
        finally:
            for hook in hooks:
                hook.remove()
        log.info(
            "learned rounding: layer %d of %d, output error %.4g (nearest) -> %.4g",
            index + 1, len(inner.layers), before, after,
        )  # fmt: skip
        if record is not None:
            record[f"model.layers.{index}"] = (before, after)
    return grids


Error = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _error_fn(
    per_token: bool, head: Callable[[torch.Tensor], torch.Tensor] | None, head_tokens: int
) -> Error:
    """``(out, target) -> loss`` of a layer's output stream: the KL divergence of the
    next-token distributions through ``head``, else the mean squared error (with
    ``per_token``, each token's relative to its target's mean square)."""
    if head is not None:

        def kl(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            rows = torch.linspace(0, len(out) - 1, min(head_tokens, len(out))).long()
            with torch.no_grad():
                reference = F.log_softmax(head(target[rows]).float(), dim=-1)
            logp = F.log_softmax(head(out[rows]).float(), dim=-1)
            return F.kl_div(logp, reference, log_target=True, reduction="batchmean")

        return kl

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        squared = (out - target).square()
        if per_token:
            squared = squared / target.square().mean(dim=-1, keepdim=True).clamp(min=1e-12)
        return squared.mean()

    return mse


@torch.no_grad()
def _mean_loss(
    layer: nn.Module,
    rounders: dict[str, Int4Rounding | Fp8Rounding],
    ropes: list,
    states: list[Stream],
    targets: list[torch.Tensor],
    ctx: ForwardContext,
    error: Error,
    packs: list[int],
) -> float:
    """The layer's mean output error over ``packs`` (16 evenly spaced: a record, not
    a step), rounded as ``rounders`` round now."""
    weights = {f"{n}.weight": r() for n, r in rounders.items()}
    total = 0.0
    for i in packs:
        h, r = functional_call(layer, weights, (ropes[i], *states[i], ctx))
        total += error(h + r, targets[i]).item()
    return total / len(packs)


def _run(layer: nn.Module, ropes: list, states: list[Stream], ctx: ForwardContext) -> None:
    for rope, (hidden, residual) in zip(ropes, states, strict=True):
        layer(rope, hidden, residual, ctx)


__all__ = [
    "Fp8Rounding",
    "Int4Rounding",
    "PackedAttention",
    "learn_layers",
    "packed_context",
    "round_activations",
    "round_ste",
]
