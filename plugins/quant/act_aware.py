"""Activation-aware, asymmetric calibration for W8A8 (fp8): GPTQ against the float model.

Plain GPTQ (``calibration.py``) feeds each ``Linear`` the float inputs of the model being
quantized and minimizes ``|| X (W - Q)^T ||``. At inference a W8A8 kernel sees other
inputs: ``X~``, each token's activations rounded to e4m3 (per-token scales), computed by
layers whose weights are already rounded. What the model should still produce is the
float model's output ``X_fp W^T``. So here each layer's weights minimize

    || X_fp W^T - X~ Q^T ||^2

(the asymmetric objective of "GPTAQ", Li et al. 2025; written here from the idea). Its
unconstrained minimizer is ``W' = W C^T H^-1`` with ``H = X~^T X~`` and ``C = X~^T X_fp``
(``H`` damped as GPTQ damps it), and since ``X~ W'^T`` is the projection of ``X_fp W^T``
onto the span of ``X~``, the residual splits in two orthogonal parts:

    || X_fp W^T - X~ Q^T ||^2 = || X_fp W^T - X~ W'^T ||^2 + || X~ (W' - Q)^T ||^2

The first does not depend on ``Q``; GPTQ of ``W'`` under ``H`` minimizes the second. The
error that the rounded activations (and the rounded layers before) leave in the layer's
output is thereby compensated in its weights, as far as it is linear in ``X~``.

Two streams run through the decoder (``quantize_sequentially`` with ``act_round``): the
float model's (original weights, float activations), which gives ``X_fp`` for every
``Linear`` of a layer before the layer is touched, and the quantized model's, where a
forward pre-hook rounds every ``Linear``'s input as the kernel will (``fp8_activations``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.fp8 import quantize_fp8_rows

ActRound = Callable[[torch.Tensor], torch.Tensor]


def fp8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the fp8 kernels see it: each row rounded to e4m3 with its own scale (the
    reference path's ``quantize_fp8_rows``), back in float32."""
    rows = x.reshape(-1, x.shape[-1])
    q, scales = quantize_fp8_rows(rows)
    return (q.float() * scales).reshape(x.shape)


@contextlib.contextmanager
def rounded_inputs(layer: nn.Module, act_round: ActRound) -> Iterator[None]:
    """Every ``Linear`` of ``layer`` takes its input through ``act_round`` meanwhile."""
    handles = [
        m.register_forward_pre_hook(lambda _, args: (act_round(args[0]), *args[1:]))
        for m in layer.modules()
        if isinstance(m, Linear)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def target_weight(
    w: torch.Tensor, h: torch.Tensor, c: torch.Tensor, damping: float
) -> torch.Tensor:
    """``W' = W C^T H^-1`` written as ``W + W (C - H)^T H^-1``: the float weight whose output
    on the rounded inputs best matches the float model's (``h = X~^T X~``, ``c = X~^T
    X_fp``). Only the correction is damped (``H + damping mean(diag H) I``, as ``gptq``
    damps), so where the two streams agree (``C = H``) the weight is ``W`` itself."""
    h0 = h.double()
    dead = torch.diagonal(h0) == 0  # inputs always zero: their columns stay as they are
    damped = h0.clone()
    damped[dead, dead] = 1.0
    damped.diagonal().add_(damping * torch.diagonal(damped).mean())
    correction = torch.linalg.solve(damped, (c.double() - h0) @ w.double().t())  # (W' - W)^T
    out = w + correction.t().to(w.dtype)
    out[:, dead] = w[:, dead]
    return out


@dataclass
class Captured:
    """A ``Linear``'s calibration statistics (float64, ``[K, K]``): ``h`` of its rounded
    inputs ``X~``, ``hq`` of the quantized stream's inputs before rounding ``X_q``, and
    their products with the float model's inputs ``X_fp``."""

    h: torch.Tensor  # X~^T X~
    c: torch.Tensor  # X~^T X_fp
    hq: torch.Tensor  # X_q^T X_q
    cq: torch.Tensor  # X_q^T X_fp


def capture_both(
    linear: Linear,
    run: Callable[[Callable[[torch.Tensor], None]], None],
    act_round: ActRound,
    float_inputs: list[torch.Tensor],
) -> Captured:
    """``linear``'s statistics: ``run(hook)`` feeds the hook each sequence's input to
    ``linear`` on the quantized stream (unrounded), in order; ``float_inputs`` holds the
    float stream's, sequence by sequence."""
    k = linear.in_features
    out = Captured(*(torch.zeros(k, k, dtype=torch.float64) for _ in range(4)))
    seen = 0

    def take(x: torch.Tensor) -> None:
        nonlocal seen
        xq = x.reshape(-1, k).float()
        xt = act_round(xq)
        x_fp = float_inputs[seen].reshape(-1, k).float()
        assert x_fp.shape == xt.shape, "the two streams must see the same tokens"
        out.h.add_((xt.t() @ xt).double())
        out.c.add_((xt.t() @ x_fp).double())
        out.hq.add_((xq.t() @ xq).double())
        out.cq.add_((xq.t() @ x_fp).double())
        seen += 1

    run(take)
    assert seen == len(float_inputs)
    return out


def fitted(
    w: torch.Tensor, stats: Captured, damping: float, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight to round, H to round it under)`` for ``mode``: ``full`` (the float
    model's outputs from the rounded inputs), ``propagated`` (from the quantized stream's
    unrounded inputs: the earlier layers' error only, not this layer's rounding noise,
    under the rounded inputs' ``H``), ``rounded`` (``W`` itself under the rounded inputs'
    ``H``)."""
    if mode == "full":
        return target_weight(w, stats.h, stats.c, damping), stats.h
    if mode == "propagated":
        return target_weight(w, stats.hq, stats.cq, damping), stats.h
    if mode == "propagated-hq":
        return target_weight(w, stats.hq, stats.cq, damping), stats.hq
    if mode == "rounded":
        return w, stats.h
    raise ValueError(f"unknown mode {mode!r}")


def record_float_inputs(layer: nn.Module, forward_all: Callable[[], None]) -> dict[int, list]:
    """Each ``Linear``'s inputs over the float stream, by ``id(linear)``, sequence by
    sequence: ``forward_all()`` runs ``layer`` over every sequence once."""
    found: dict[int, list[torch.Tensor]] = {}
    handles = []
    for m in layer.modules():
        if isinstance(m, Linear):
            found[id(m)] = []
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, args: found[id(mod)].append(args[0].detach().float().clone())
                )
            )
    try:
        forward_all()
    finally:
        for handle in handles:
            handle.remove()
    return found
