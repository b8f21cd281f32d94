"""``prefill_fresh_16bit`` (session 38, opt-in): with an 8-bit KV cache, the requests at a
batch's end whose whole context is this step's tokens (no cached prefix) are prefilled
over their own 16-bit keys and values instead of the quantized cache. The backend
(``triton_backend.TritonAttention``) finds them in ``prepare`` and launches the prefill
kernel twice in ``forward``: the rest over the cache, these over ``page_view``."""

from __future__ import annotations

import torch

from tokenloom.protocols.components.attention import AttentionMetadata


def find_fresh(meta: AttentionMetadata, num_decodes: int) -> None:
    """The requests at the batch's end whose whole context is this step's tokens, after
    the leading decodes: ``meta.extra["fresh_from"]`` (the first of them) and
    ``["fresh_max_len"]``, where there is one (host lists only)."""
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if len(seq_lens) != len(q_lens):  # a capture's static metadata (verify graphs)
        return
    first = len(q_lens)
    while first > num_decodes and 0 < q_lens[first - 1] == seq_lens[first - 1]:
        first -= 1
    if first < len(q_lens):
        meta.extra["fresh_from"] = first
        meta.extra["fresh_max_len"] = max(q_lens[first:])


def page_view(
    k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's keys and values (``[T, heads, D]``, rotated) as a cache of one-token
    pages (``[T, 1, heads, D]``), and a block table of each request's rows."""
    rows = torch.arange(int(meta.extra["fresh_max_len"]), device=k.device)
    table = (meta.query_start_loc[:-1, None] + rows[None, :].int()).int()
    if k.stride() != v.stride():  # the kernel reads both with the keys' strides
        k, v = k.contiguous(), v.contiguous()
    return k.unsqueeze(1), v.unsqueeze(1), table
