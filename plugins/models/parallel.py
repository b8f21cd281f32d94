"""The tensor-parallel group a model is built for: rank, size and its collectives.

A model is built under ``with parallel.use(group):`` (as it is built under ``with
torch.device(...)``); each layer reads ``parallel.current()`` once, at construction,
and keeps it. The default group is a single rank whose collectives return their input,
so a model built outside any ``use`` is the whole model on one device.

Sharding rules (the one place they are stated):
- a column-parallel linear layer (q/k/v, gate/up) holds, per merged part, the rows
  ``part_range(...)`` of the checkpoint tensor; its output stays sharded;
- a row-parallel layer (o_proj, down) holds the input columns ``even_range(in, size,
  rank)`` and all-reduces its output; its bias (if any) is added once, after the sum;
- attention heads split evenly; KV heads split evenly when there are at least as many
  as ranks, else each rank holds KV head ``rank * num_kv // size`` (replicated), so
  every rank's query heads find their group's KV head;
- embedding and LM head are vocab-parallel: rows ``even_range(vocab_padded, ...)``, the
  vocabulary padded to a multiple of the size; the LM head's logits are all-gathered,
  so every rank holds the full logits and samples the same tokens (same seeds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tokenloom.protocols.components.model import ModelInfo


class ParallelGroup:
    """A single rank: the collectives are the identity. Distributed groups subclass it."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (may work in place; use the returned tensor)."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, in rank order."""
        return x


SINGLE = ParallelGroup()
_current: ParallelGroup = SINGLE


def current() -> ParallelGroup:
    return _current


@contextmanager
def use(group: ParallelGroup) -> Iterator[ParallelGroup]:
    """Layers built inside this block belong to ``group``."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def even_range(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``total`` that ``rank`` of ``size`` holds; ``size`` must
    divide ``total``."""
    if total % size:
        raise ValueError(f"{total} does not split evenly across {size} ranks")
    part = total // size
    return rank * part, (rank + 1) * part


def head_range(num_heads: int, head_dim: int, size: int, rank: int) -> tuple[int, int]:
    """Rows of a q/k/v projection that ``rank`` holds: an even split of the heads, or,
    with fewer heads than ranks, the one head ``rank * num_heads // size`` (replicated).
    Raises ValueError when neither divides the other."""
    if num_heads >= size:
        if num_heads % size:
            raise ValueError(
                f"{num_heads} heads do not split evenly across {size} ranks: "
                "tensor_parallel_size must divide the number of attention heads"
            )
        start, stop = even_range(num_heads, size, rank)
    elif size % num_heads == 0:
        start = rank * num_heads // size
        stop = start + 1
    else:
        raise ValueError(f"{num_heads} KV heads cannot be shared by {size} ranks")
    return start * head_dim, stop * head_dim


def rank_model_info(info: ModelInfo, group: ParallelGroup) -> ModelInfo:
    """``info`` as one rank sees it: its own query and KV heads (what its attention
    backend and KV cache are built for). The same object for a single rank."""
    if group.size == 1:
        return info
    q = head_range(info.num_heads, 1, group.size, group.rank)
    kv = head_range(info.num_kv_heads, 1, group.size, group.rank)
    return dataclasses.replace(info, num_heads=q[1] - q[0], num_kv_heads=kv[1] - kv[0])
