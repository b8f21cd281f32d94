"""The split-KV decode's scratch: each split's partial output and log-sum-exp, and the
arrival counters with which the last split of a request merges them (``decode_tile``).

One set per micro-batch lane (``AttentionMetadata.extra["lane"]``): two decode launches of
one step may run at once on two streams (``plugins.executor.micro_batches``), and a
program indexes the scratch by its row's place in its own launch, so the lanes must not
share it. Each set is allocated outside any graph capture (the backend's ``prepare``), at
the largest batch up to ``max_num_seqs``, and only ever grows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DecodeScratch:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        device: torch.device,
        num_splits: Callable[[int], int],
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.num_splits = num_splits  # the backend's: KV splits of a batch
        self.lanes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _rows(self, max_batch: int) -> int:
        """Rows of ``[num_heads, head_dim]`` partials the largest batch needs."""
        return max(b * self.num_splits(b) for b in range(1, max_batch + 1))

    def get(self, batch: int, lane: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lane ``lane``'s partials ``[rows * num_heads * head_dim]``, their log-sum-exps
        ``[rows * num_heads]`` (fp32) and its zeroed counters ``[batch * num_kv_heads]``
        (int32), grown to hold ``batch``."""
        rows = batch * self.num_splits(batch)
        part_out, part_lse, counters = self.lanes.get(lane, (None, None, None))
        if part_out is None or part_out.numel() < rows * self.num_heads * self.head_dim:
            rows = max(rows, self._rows(max(batch, self.max_num_seqs)))
            size = rows * self.num_heads
            part_out = torch.empty(size * self.head_dim, dtype=torch.float32, device=self.device)
            part_lse = torch.empty(size, dtype=torch.float32, device=self.device)
        if counters is None or counters.numel() < batch * self.num_kv_heads:
            size = max(batch, self.max_num_seqs) * self.num_kv_heads
            counters = torch.zeros(size, dtype=torch.int32, device=self.device)
        assert part_lse is not None
        self.lanes[lane] = (part_out, part_lse, counters)
        return part_out, part_lse, counters
