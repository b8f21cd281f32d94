"""Truncation filters (top-k, top-p, min-p) and the exponential-race draw.

Each filter sets the logits of excluded tokens to -inf and never removes a row's most
likely token, so a greedy row passes through unchanged in its argmax. All shapes are
fixed by the batch: no host sync, no data-dependent shapes.
"""

from __future__ import annotations

import torch


def apply_top_k(
    logits: torch.Tensor,  # [B, V] float32
    top_k: torch.Tensor,  # [B, 1] int64 in [1, max_top_k]; max_top_k = off for that row
    max_top_k: int,  # host: the largest k of any filtering row
    top_k_off: torch.Tensor,  # [B, 1] bool: rows that keep every token
) -> torch.Tensor:  # [B, V], modified in place
    """Keep each row's k largest logits (ties with the k-th are kept too)."""
    largest = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    threshold = largest.gather(1, top_k - 1)  # [B, 1]
    threshold.masked_fill_(top_k_off, float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V] float32
    top_k: torch.Tensor | None,  # [B, 1] int64 (>= the candidates' width = off)
    top_p: torch.Tensor,  # [B, 1] float32 in (0, 1]; > 1 = off
    max_top_k: int | None,  # host: every row has a top-k of at most this; None = some row has none
) -> torch.Tensor:  # [B, V], a new tensor
    """Top-k then top-p (nucleus): keep the smallest set of most likely tokens whose
    probability (renormalised after top-k) reaches p. When every row has a top-k the
    candidates come from ``topk`` (cheap); otherwise from a full sort."""
    if max_top_k is None:
        candidates, order = logits.sort(dim=-1, descending=True)  # [B, V] each
        out = torch.empty_like(logits)
    else:
        candidates, order = logits.topk(max_top_k, dim=-1)  # [B, max_top_k] each, descending
        out = torch.full_like(logits, float("-inf"))
    if top_k is not None:
        rank = torch.arange(candidates.shape[-1], device=logits.device)  # [C]
        candidates.masked_fill_(rank >= top_k, float("-inf"))
    probs = candidates.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, C]: exclusive cumsum
    candidates.masked_fill_(mass_before > top_p, float("-inf"))
    return out.scatter_(1, order, candidates)


def apply_min_p(
    logits: torch.Tensor,  # [B, V] float32
    min_p: torch.Tensor,  # [B, 1] float32 in [0, 1]; 0 = off
) -> torch.Tensor:  # [B, V], modified in place
    """Drop tokens whose probability is below ``min_p`` times the row's largest."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p  # [B, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def exponential_race(
    probs: torch.Tensor,  # [B, V] float32, rows sum to 1
    noise: torch.Tensor,  # [B, V] float32, i.i.d. Exp(1) draws
) -> torch.Tensor:  # [B] int64
    """Sample one token per row: argmax(p / E) with E ~ Exp(1) picks token i with
    probability p_i (the smallest E_i / p_i wins an exponential race), without the
    host sync of ``torch.multinomial``. Consumes ``noise``."""
    # An Exp(1) draw can underflow to 0; p / 0 would be inf (or nan for p = 0).
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)
