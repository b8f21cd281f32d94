"""Exact rejection sampling of draft tokens (speculative decoding), on the device.

A request that verifies ``k`` drafts ``d_1 .. d_k`` has ``k + 1`` rows of target
distributions: row ``j`` (0-based) is the distribution of the token after ``d_j``
(row 0: after the last known token). Row ``j < k`` verifies ``d_{j+1}``:

- greedy rows accept when ``d_{j+1}`` is the row's argmax;
- sampled rows accept with probability ``min(1, p(d) / q(d))``, where ``q`` is the
  proposer's distribution (one-hot at ``d`` for deterministic proposers, so the
  test is ``u < p(d)``).

The first rejected row emits a token from the residual ``max(0, p - q)``
(normalised; the argmax for greedy rows); when every draft is accepted, the last
row emits a bonus token drawn from ``p``. This makes the emitted tokens exactly
distributed as sampling from ``p`` one token at a time (Leviathan et al. 2023,
Chen et al. 2023). Everything is vectorised over rows; the per-request layout is a
small padded index matrix built on the host.
"""

from __future__ import annotations

import torch

from tokenloom.plugins.executor.sampling.logits_filters import exponential_race


def rejection_sample(
    probs: torch.Tensor,  # [R, V] float32: the target's processed distributions
    draft_ids: torch.Tensor,  # [R] int64: the draft each row verifies; -1 on bonus rows
    greedy: torch.Tensor,  # [R] bool: rows of greedy requests
    layout: torch.Tensor,  # [B, K + 1] int64: each request's rows in order; -1 = padding
    uniform: torch.Tensor,  # [R] float32 in [0, 1)
    noise: torch.Tensor,  # [R, V] float32, i.i.d. Exp(1); consumed
    draft_probs: torch.Tensor | None = None,  # [R, V] q per row; None: one-hot at the draft
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K + 1] int64 tokens, [B] int64 accepted
    """Verify every request's drafts. Returns each request's tokens (the first
    ``accepted + 1`` of its row are valid: accepted drafts, then the correction or
    bonus token) and how many drafts it accepted."""
    has_draft = draft_ids >= 0
    safe_drafts = draft_ids.clamp(min=0).unsqueeze(1)  # [R, 1]
    p_draft = probs.gather(1, safe_drafts).squeeze(1)  # [R]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(probs).scatter_(1, safe_drafts, has_draft.unsqueeze(1).float())
    else:
        q = draft_probs * has_draft.unsqueeze(1)
        q_draft = q.gather(1, safe_drafts).squeeze(1)
    argmax = probs.argmax(dim=-1)  # [R]
    accept = torch.where(greedy, argmax == draft_ids, uniform * q_draft < p_draft) & has_draft

    residual = (probs - q).clamp_(min=0.0)
    # A zero residual means p == q on this row: its draft is accepted with probability
    # 1, so the residual is never used there; keep p to stay finite.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    recovered = torch.where(greedy, argmax, exponential_race(residual, noise))  # [R]

    return _emit(accept, recovered, draft_ids, layout)


def greedy_verify(
    argmax: torch.Tensor,  # [R] int64: each row's argmax (of logits that need no processing)
    draft_ids: torch.Tensor,  # [R] int64; -1 on bonus rows
    layout: torch.Tensor,  # [B, K + 1] int64; -1 = padding
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for a batch of greedy requests only: accept while the
    draft is the argmax, then the argmax (a handful of kernels, no [R, V] work)."""
    return _emit(argmax == draft_ids, argmax, draft_ids, layout)


def _emit(
    accept: torch.Tensor,  # [R] bool (False on bonus rows)
    recovered: torch.Tensor,  # [R] int64: the token a row emits when its draft is rejected
    draft_ids: torch.Tensor,  # [R] int64
    layout: torch.Tensor,  # [B, K + 1] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's accepted prefix of drafts, then its first non-accepting row's token."""
    padded = layout < 0
    rows = layout.clamp(min=0)  # [B, K + 1]
    accepted_pad = accept[rows] & ~padded
    num_accepted = accepted_pad.long().cumprod(dim=1).sum(dim=1)  # [B]
    column = torch.arange(layout.shape[1], device=layout.device).unsqueeze(0)
    tokens = torch.where(column < num_accepted.unsqueeze(1), draft_ids[rows], recovered[rows])
    return tokens, num_accepted


def row_layout(num_drafts: list[int]) -> list[list[int]]:
    """The padded row-index matrix of requests with these draft counts (host lists):
    request ``b`` owns ``num_drafts[b] + 1`` consecutive rows."""
    width = max(num_drafts, default=0) + 1
    layout = []
    row = 0
    for k in num_drafts:
        layout.append(list(range(row, row + k + 1)) + [-1] * (width - k - 1))
        row += k + 1
    return layout
