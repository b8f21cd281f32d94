"""End-to-end tuning of the quantized weights' scales: after the layer-by-layer rounding
(GPTQ or learned rounding), every zero point and (unless ``codes``, below) every code
stays as it is and each int4 group's float16 scale, or each fp8 row's float32 scale
(and optionally every RMS norm's weight), is trained on the whole model's
next-token distributions against the float model's (the KL divergence), by Adam. For
fp8 every quantized ``Linear``'s input is rounded per token in the loop as the W8A8
kernels round it (straight through).

This is the second phase of EfficientQAT (Chen et al. 2024, "EfficientQAT: Efficient
Quantization-Aware Training for Large Language Models", E2E-QP; written here from the
paper), with the float model as the teacher instead of the data's next tokens. The
layer-wise methods each see one layer's output; only this step sees what the
perplexity measures. It trains 1/128 of the parameters a weight has (one scale per
group of 128 weights; fp8: one per row), so it cannot overfit a small calibration set the way training
the weights would, and the checkpoint format is unchanged.

Scales are trained as ``s = s0 * exp(t)`` (``t`` starts at 0; a relative step), rounded
to float16 in the forward pass (straight through), so what is trained is what is stored.
Optionally (``codes``) the int4 codes of learned rounding train too, from its weights and
offsets: ``q = round(w / s0 + v) + z``, ``v`` in [-1/2, 1/2] (EfficientQAT's first phase
trains the weights block by block; this moves SignRound's offsets end to end). The
rounding's own scales ``s0`` place the codes, so a trained scale rescales them without
moving them: through ``round(w / s)`` its straight-through gradient flipped codes near
their boundaries at random, and the tiny test model's KL rose instead of falling.
Sequences of one length are packed ``batch`` at a time (``signround.PackedAttention``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tokenloom.logging import get_logger
from tokenloom.plugins.models.layers import RMSNorm
from tokenloom.plugins.quant.calibration import model_device
from tokenloom.plugins.quant.gptq import Fp8Grid, Grid, Int4Grid
from tokenloom.plugins.quant.signround import packed_context, round_activations, round_ste

log = get_logger(__name__)


class _DequantizedLinear(torch.autograd.Function):
    """``y = x W^T`` with ``W = (codes - zeros) * scales``, one scale and zero point per
    group of ``group`` inputs (fp8: one scale a row, no zero points). ``W`` is made
    again in the backward pass instead of kept: autograd keeps the input and the codes
    (a byte a weight), where ``F.linear`` on a made weight keeps that float32 weight
    and the product's two float32 factors, 12 bytes a weight, for every layer until
    the backward pass (about 84 GB for an 8B model)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scales: torch.Tensor,
        codes: torch.Tensor,
        zeros: torch.Tensor | None,
        group: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, scales, codes, zeros)
        ctx.group = group
        return F.linear(x, _steps(codes, zeros, group) * _expand(scales, group, codes.shape[1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scales, codes, zeros = ctx.saved_tensors
        n, k = codes.shape
        steps = _steps(codes, zeros, ctx.group)
        grad_x = grad_scales = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ (steps * _expand(scales, ctx.group, k))
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, n).t() @ x.reshape(-1, k)
            grad_w = F.pad(grad_w.mul_(steps), (0, scales.shape[1] * ctx.group - k))
            grad_scales = grad_w.view(n, scales.shape[1], ctx.group).sum(dim=2)
        return grad_x, grad_scales, None, None, None


def _expand(per_group: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """``[N, G]`` per group of ``group`` inputs -> ``[N, k]`` (``[N, 1]`` broadcasts)."""
    return per_group if per_group.shape[1] == 1 else per_group.repeat_interleave(group, 1)[:, :k]


def _steps(codes: torch.Tensor, zeros: torch.Tensor | None, group: int) -> torch.Tensor:
    """``codes - zeros`` in float32, ``[N, K]``."""
    steps = codes.float()
    return steps if zeros is None else steps - _expand(zeros, group, codes.shape[1])


class _Scales(nn.Module):
    """One ``Int4Grid``'s weight as ``(codes - zeros) * scales``, the scales trainable."""

    def __init__(self, grid: Int4Grid) -> None:
        super().__init__()
        assert grid.codes is not None
        n, k = grid.codes.shape
        self.group, self.k, self.grid = grid.group, k, grid
        self.register_buffer("scale0", torch.stack(grid.scales).t().contiguous())  # [N, G]
        self.register_buffer("codes0", grid.codes)  # [N, K] uint8, 0..15 (not a copy)
        self.register_buffer("zeros", torch.stack(grid.zeros).t().contiguous())  # [N, G]
        self.t = nn.Parameter(torch.zeros_like(self.scale0))
        # ``train_codes``: learned rounding's weights and offsets (``Int4Grid.latent``),
        # codes = round(w / s + v) + z with v trainable, as in the layer-wise fit
        self.w: torch.Tensor | None
        self.register_buffer("w", None)
        self.v = nn.Parameter(torch.zeros(0))

    def train_codes(self) -> nn.Parameter | None:
        """Make the codes trainable (``Int4Grid.latent`` needed); the offsets, or None."""
        if self.grid.latent is None:
            return None
        self.w, self.v = self.grid.latent[0], nn.Parameter(self.grid.latent[1])
        if not torch.equal(self.codes(), self.codes0.float()):
            raise ValueError("Int4Grid.latent does not give the grid's codes")
        return self.v

    def scales(self) -> torch.Tensor:
        scale = self.scale0 * torch.exp(self.t)
        return scale + (scale.half().float() - scale).detach()  # stored as float16

    def codes(self) -> torch.Tensor:
        if self.w is None:
            return self.codes0.float()
        # against the rounding's own scales: a trained scale rescales the codes, it does
        # not move them (through round(w / s), its straight-through gradient is noise)
        return (
            round_ste(self.w / _expand(self.scale0, self.group, self.k) + self.v)
            + _expand(self.zeros, self.group, self.k)
        ).clamp(0, 15)

    def forward(self) -> torch.Tensor:
        steps = self.codes() - _expand(self.zeros, self.group, self.k)
        return steps * _expand(self.scales(), self.group, self.k)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T``: the codes' bytes kept for the backward pass, not a float weight
        (trained codes go through autograd's own path)."""
        if self.w is not None:
            return F.linear(x, self())
        return _DequantizedLinear.apply(x, self.scales(), self.codes0, self.zeros, self.group)

    @torch.no_grad()
    def store(self) -> torch.Tensor:
        """Write the trained scales (and codes) into the grid; returns the weight they give."""
        self.grid.scales = list(self.scales().t().contiguous())
        self.grid.codes = self.codes().to(torch.uint8)
        self.grid.latent = None  # its offsets moved; and 8 bytes a weight freed
        return self()


class _RowScales(nn.Module):
    """One ``Fp8Grid``'s weight as ``codes * scales``, the row scales trainable."""

    def __init__(self, grid: Fp8Grid) -> None:
        super().__init__()
        assert grid.codes is not None and grid.scales is not None
        self.grid = grid
        self.register_buffer("codes", grid.codes)  # [N, K] e4m3 (not a copy)
        self.register_buffer("scale0", grid.scales.float().clone())  # [N, 1]
        self.t = nn.Parameter(torch.zeros_like(self.scale0))

    def forward(self) -> torch.Tensor:
        return self.codes.float() * (self.scale0 * torch.exp(self.t))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.scale0 * torch.exp(self.t)
        return _DequantizedLinear.apply(x, scales, self.codes, None, self.codes.shape[1])

    @torch.no_grad()
    def store(self) -> torch.Tensor:
        self.grid.scales = self.scale0 * torch.exp(self.t)
        return self()


def _projection(linear: nn.Module, scales: _Scales | _RowScales) -> Any:
    """A forward for ``linear`` (a ``layers.Linear``, one device, no kernel) that
    multiplies by the trained weight of ``scales`` (``project``), plus its bias."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = scales.project(x)
        return y if linear.bias is None else y + linear.bias

    return forward


def _packs(
    sequences: list[list[int]], batch: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, positions)`` of ``batch`` sequences at a time, packed, on ``device``."""
    length = len(sequences[0])
    if any(len(s) != length for s in sequences):
        raise ValueError("scale tuning packs sequences of one length")
    packs = [sequences[i : i + batch] for i in range(0, len(sequences), batch)]
    return [
        (
            torch.tensor([t for s in p for t in s], device=device),
            torch.arange(length, device=device).repeat(len(p)),
        )
        for p in packs
    ]


@torch.no_grad()
def teacher_log_probs(
    model: nn.Module, sequences: list[list[int]], batch: int = 4
) -> list[torch.Tensor]:
    """The (float) model's next-token log-probabilities on every pack of ``sequences``,
    stored as float16 ``[tokens, vocab]`` in host memory (2 bytes a token and vocabulary
    entry: host memory is the larger), the targets of ``tune_scales``."""
    ctx = packed_context(model, len(sequences[0]))
    return [
        F.log_softmax(model.compute_logits(model(ids, pos, ctx)), dim=-1).half().cpu()
        for ids, pos in _packs(sequences, batch, model_device(model))
    ]


def tune_scales(
    model: nn.Module,
    sequences: list[list[int]],
    grids: dict[str, Grid],
    teacher: list[torch.Tensor],
    steps: int,
    batch: int = 4,
    lr: float = 1e-3,
    norms: bool = False,
    codes: float = 0.0,
) -> tuple[float, float]:
    """Train the scales of every grid in ``grids`` (by module name) for
    ``steps`` Adam steps of one pack each; the grids and the model's weights then hold
    the trained values. ``teacher``: ``teacher_log_probs`` of the float model on the
    same ``sequences`` and ``batch``. ``norms``: the RMS norms' weights train with them
    (relative steps, like the scales): a per-input-channel factor on the projections
    they feed, which no group or row scale can express (Norm Tweaking, Li et al. 2023,
    does this layer-wise). ``codes``: when above 0, the int4 codes of learned rounding's
    grids (``Int4Grid.latent``) train too, at this rate (a separate Adam group, falling
    linearly to 0): ``q = round(w / s0 + v) + z`` with the rounding's own scales ``s0``,
    every offset ``v`` in [-1/2, 1/2] as in the layer-wise fit, now against the whole
    model's KL beside the trained scales: a joint end-to-end fit of rounding and scales.
    Returns the mean KL over every pack, before and after."""
    scales: dict[str, _Scales | _RowScales] = {
        n: _Scales(g) if isinstance(g, Int4Grid) else _RowScales(g)  # type: ignore[arg-type]
        for n, g in grids.items()
    }
    gains = {
        n: (
            m.weight.detach().clone(),
            nn.Parameter(torch.zeros_like(m.weight, dtype=torch.float32)),
        )
        for n, m in model.named_modules()
        if norms and isinstance(m, RMSNorm)
    }
    offsets = []
    if codes > 0:
        for s in scales.values():
            v = s.train_codes() if isinstance(s, _Scales) else None
            if v is not None:
                offsets.append(v)
        if not offsets:
            log.warning("scale tuning: no learned rounding to train the codes from")
    device = model_device(model)
    packs = _packs(sequences, batch, device)
    if len(teacher) != len(packs):
        raise ValueError("teacher_log_probs must come from the same sequences and batch")
    ctx = packed_context(model, len(sequences[0]))
    model.requires_grad_(False)

    def kl(i: int) -> torch.Tensor:
        weights = {f"{n}.weight": w0 * torch.exp(u) for n, (w0, u) in gains.items()}
        ids, pos = packs[i]
        hidden = functional_call(model, weights, (ids, pos, ctx))
        logp = F.log_softmax(model.compute_logits(hidden), dim=-1)
        target = teacher[i].to(device, non_blocking=True).float()
        return F.kl_div(logp, target, log_target=True, reduction="batchmean")

    def mean_kl() -> float:
        with torch.no_grad():
            return sum(float(kl(i)) for i in range(len(packs))) / len(packs)

    hooks = []
    swapped: list[nn.Module] = []
    try:
        for name, s in scales.items():  # each quantized Linear computes from its codes
            linear = model.get_submodule(name)
            if isinstance(s, _RowScales):
                hooks.append(linear.register_forward_pre_hook(round_activations))
            linear.forward = _projection(linear, s)
            swapped.append(linear)
        before = mean_kl()
        trained = [s.t for s in scales.values()] + [u for _, u in gains.values()]
        groups: list[dict] = [{"params": trained, "lr": lr}]
        if offsets:
            groups.append({"params": offsets, "lr": codes})
        optimizer = torch.optim.Adam(groups)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = kl(step % len(packs))
            loss.backward()
            if offsets:
                optimizer.param_groups[1]["lr"] = codes * (1 - step / steps)
            optimizer.step()
            with torch.no_grad():
                for v in offsets:
                    v.clamp_(-0.5, 0.5)
            if (step + 1) % len(packs) == 0 or step + 1 == steps:
                log.info(
                    "scale tuning: step %d of %d, KL %.4g", step + 1, steps, loss.detach().item()
                )
        if offsets:
            with torch.no_grad():
                moved = sum(
                    int((s.codes() != s.codes0.float()).sum())
                    for s in scales.values()
                    if isinstance(s, _Scales)
                )
            total = sum(v.numel() for v in offsets)
            log.info(
                "scale tuning: %d of %d codes moved (%.3g%%)", moved, total, 100 * moved / total
            )
        for name, s in scales.items():
            model.get_submodule(name).weight.data.copy_(s.store())
        with torch.no_grad():
            for name, (w0, u) in gains.items():
                model.get_submodule(name).weight.copy_(w0 * torch.exp(u))
        after = mean_kl()
    finally:
        for hook in hooks:
            hook.remove()
        for linear in swapped:
            del linear.forward  # the class's own again
    log.info("scale tuning: mean KL %.4g -> %.4g over %d packs", before, after, len(packs))
    return before, after


__all__ = ["teacher_log_probs", "tune_scales"]
