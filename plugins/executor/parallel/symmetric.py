"""One-shot all-reduce through symmetric memory, for the small messages of decode.

Opt-in: ``[plugin.model] symm_mem_all_reduce = true`` (bench: ``--plugin-option
model.symm_mem_all_reduce=true``), NCCL groups only. At start-up every rank allocates
one symmetric buffer (``torch.distributed._symmetric_memory``) and the group times
NCCL against ``one_shot_all_reduce`` at the sizes decode produces (rows x hidden);
messages up to the largest size where one-shot won on rank 0 (broadcast, so every
rank switches at the same size) are copied into the buffer and reduced there; larger
ones stay on NCCL. Both are CUDA-graph capturable. ``core/bench/allreduce.py``
measures the same comparison over a wider range of sizes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from tokenloom.plugins.executor.settings import ModelExecutorSettings
from tokenloom.plugins.models.cuda_timing import median_cuda_us

log = logging.getLogger("tokenloom.executor.parallel")


TUNE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class SymmetricAllReduce:
    """A symmetric buffer of ``max_rows x hidden`` and the size threshold below which
    ``__call__`` is used instead of NCCL."""

    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.group.WORLD
        assert world is not None
        self.group_name = world.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
            symm_mem.enable_symm_mem_for_group(self.group_name)
        device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(max_rows * hidden, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.max_numel = 0  # the threshold; 0 until tuned
        self.hidden = hidden

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer[: x.numel()]
        buf.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        return out.view(x.shape)

    def tune(self, max_rows: int) -> int:
        """Time both at decode sizes (every rank, in lockstep) and keep the largest
        size up to which one-shot beat NCCL at every size, as rank 0 measured it."""
        timings = []  # every rank runs every size: the collectives must pair up
        for rows in (r for r in TUNE_ROWS if r <= max_rows):
            x = torch.randn(rows, self.hidden, dtype=self.buffer.dtype, device=self.buffer.device)
            nccl = median_cuda_us(lambda: dist.all_reduce(x))  # noqa: B023 (called at once)
            one_shot = median_cuda_us(lambda: self(x))  # noqa: B023
            timings.append((rows, nccl, one_shot))
        best = 0
        for rows, nccl, one_shot in timings:
            if one_shot >= nccl:
                break
            best = rows * self.hidden
        decision = torch.tensor([best], dtype=torch.int64, device=self.buffer.device)
        dist.broadcast(decision, src=0)
        self.max_numel = int(decision.item())
        log.info(
            "symmetric-memory one-shot all-reduce up to %d elements (%d rows)",
            self.max_numel,
            self.max_numel // self.hidden,
        )
        return self.max_numel


def enable(group: Any, config: Any, hidden: int, dtype: torch.dtype) -> None:
    """Give ``group`` (a ``DistributedGroup``) a tuned symmetric all-reduce when the
    config asks for it and the group runs on NCCL; every rank calls this at the same
    point of its start-up."""
    from tokenloom.config import plugin_settings

    wanted = plugin_settings(config, "model", ModelExecutorSettings).symm_mem_all_reduce
    if group.backend != "nccl" or not wanted:
        return
    symmetric = SymmetricAllReduce(config.max_num_seqs, hidden, dtype)
    if symmetric.tune(config.max_num_seqs):
        group.symmetric = symmetric
