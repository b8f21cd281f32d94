"""End-to-end tuning of the quantized weights' scales: after the layer-by-layer rounding
(GPTQ or learned rounding), every code and zero point stays as it is and each int4
group's float16 scale, or each fp8 row's float32 scale, is trained on the whole model's
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
Sequences of one length are packed ``batch`` at a time (``signround.PackedAttention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tokenloom.logging import get_logger
from tokenloom.plugins.models.layers import RMSNorm
from tokenloom.plugins.quant.gptq import Fp8Grid, Grid, Int4Grid
from tokenloom.plugins.quant.signround import packed_context, round_activations

log = get_logger(__name__)


class _Scales(nn.Module):
    """One ``Int4Grid``'s weight as ``(codes - zeros) * scales``, the scales trainable."""

    def __init__(self, grid: Int4Grid) -> None:
        super().__init__()
        assert grid.codes is not None
        n, k = grid.codes.shape
        self.group, self.k, self.grid = grid.group, k, grid
        zeros = torch.stack(grid.zeros).t()  # [N, G]
        self.register_buffer("scale0", torch.stack(grid.scales).t().contiguous())  # [N, G]
        steps = grid.codes.float() - zeros.repeat_interleave(self.group, dim=1)[:, :k]
        self.register_buffer("steps", steps)  # [N, K]: codes - zero, integers
        self.t = nn.Parameter(torch.zeros_like(self.scale0))

    def scales(self) -> torch.Tensor:
        scale = self.scale0 * torch.exp(self.t)
        return scale + (scale.half().float() - scale).detach()  # stored as float16

    def forward(self) -> torch.Tensor:
        return self.steps * self.scales().repeat_interleave(self.group, dim=1)[:, : self.k]

    @torch.no_grad()
    def store(self) -> torch.Tensor:
        """Write the trained scales into the grid; returns the weight they give."""
        self.grid.scales = list(self.scales().t().contiguous())
        return self()


class _RowScales(nn.Module):
    """One ``Fp8Grid``'s weight as ``codes * scales``, the row scales trainable."""

    def __init__(self, grid: Fp8Grid) -> None:
        super().__init__()
        assert grid.codes is not None and grid.scales is not None
        self.grid = grid
        self.register_buffer("codes", grid.codes.float())  # [N, K] e4m3 values
        self.register_buffer("scale0", grid.scales.float().clone())  # [N, 1]
        self.t = nn.Parameter(torch.zeros_like(self.scale0))

    def forward(self) -> torch.Tensor:
        return self.codes * (self.scale0 * torch.exp(self.t))

    @torch.no_grad()
    def store(self) -> torch.Tensor:
        self.grid.scales = self.scale0 * torch.exp(self.t)
        return self()


def _packs(sequences: list[list[int]], batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, positions)`` of ``batch`` sequences at a time, packed."""
    length = len(sequences[0])
    if any(len(s) != length for s in sequences):
        raise ValueError("scale tuning packs sequences of one length")
    packs = [sequences[i : i + batch] for i in range(0, len(sequences), batch)]
    return [
        (torch.tensor([t for s in p for t in s]), torch.arange(length).repeat(len(p)))
        for p in packs
    ]


@torch.no_grad()
def teacher_log_probs(
    model: nn.Module, sequences: list[list[int]], batch: int = 4
) -> list[torch.Tensor]:
    """The (float) model's next-token log-probabilities on every pack of ``sequences``,
    stored as float16 ``[tokens, vocab]``: the targets of ``tune_scales``."""
    ctx = packed_context(model, len(sequences[0]))
    return [
        F.log_softmax(model.compute_logits(model(ids, pos, ctx)), dim=-1).half()
        for ids, pos in _packs(sequences, batch)
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
) -> tuple[float, float]:
    """Train the scales of every grid in ``grids`` (by module name) for
    ``steps`` Adam steps of one pack each; the grids and the model's weights then hold
    the trained values. ``teacher``: ``teacher_log_probs`` of the float model on the
    same ``sequences`` and ``batch``. ``norms``: the RMS norms' weights train with them
    (relative steps, like the scales): a per-input-channel factor on the projections
    they feed, which no group or row scale can express (Norm Tweaking, Li et al. 2023,
    does this layer-wise). Returns the mean KL over every pack, before and after."""
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
    packs = _packs(sequences, batch)
    if len(teacher) != len(packs):
        raise ValueError("teacher_log_probs must come from the same sequences and batch")
    ctx = packed_context(model, len(sequences[0]))
    model.requires_grad_(False)

    def kl(i: int) -> torch.Tensor:
        weights = {f"{n}.weight": s() for n, s in scales.items()}
        weights.update({f"{n}.weight": w0 * torch.exp(u) for n, (w0, u) in gains.items()})
        ids, pos = packs[i]
        hidden = functional_call(model, weights, (ids, pos, ctx))
        logp = F.log_softmax(model.compute_logits(hidden), dim=-1)
        return F.kl_div(logp, teacher[i].float(), log_target=True, reduction="batchmean")

    def mean_kl() -> float:
        with torch.no_grad():
            return sum(float(kl(i)) for i in range(len(packs))) / len(packs)

    hooks = [
        model.get_submodule(n).register_forward_pre_hook(round_activations)
        for n, g in grids.items()
        if isinstance(g, Fp8Grid)
    ]
    try:
        before = mean_kl()
        trained = [s.t for s in scales.values()] + [u for _, u in gains.values()]
        optimizer = torch.optim.Adam(trained, lr=lr)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = kl(step % len(packs))
            loss.backward()
            optimizer.step()
            if (step + 1) % len(packs) == 0 or step + 1 == steps:
                log.info(
                    "scale tuning: step %d of %d, KL %.4g", step + 1, steps, loss.detach().item()
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
    log.info("scale tuning: mean KL %.4g -> %.4g over %d packs", before, after, len(packs))
    return before, after


__all__ = ["teacher_log_probs", "tune_scales"]
