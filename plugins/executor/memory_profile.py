"""The KV pool's size on a GPU: a forward pass at the largest token budget, its peak
memory, and the rest of ``gpu_memory_utilization`` for the cache (``tokenloom plan``
mirrors this rule)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData, ScheduledChunk, StepInput

GiB = 1 << 30


class ProfiledRunner(Protocol):
    """What the profile needs of an executor (``ModelRunner`` is one): a pool it can
    make and drop, a step it can run, and where to report the memory it found."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def info(self) -> ModelInfo: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def memory(self) -> dict[str, float]: ...  # GiB, updated in place

    def init_kv_cache(self, num_blocks: int, block_size: int, capture: bool = True) -> None: ...
    def free_kv_cache(self) -> None: ...
    def execute(self, step: StepInput) -> Any: ...


@torch.inference_mode()
def profile_num_blocks(runner: ProfiledRunner, block_size: int, per_block: int) -> int:
    """Run a forward pass at the largest token budget, measure the peak, and give
    the rest of ``gpu_memory_utilization`` to the KV pool."""
    cfg = runner.config
    max_len = cfg.max_model_len or runner.info.max_model_len
    budget = cfg.max_num_batched_tokens
    lengths: list[int] = []
    while budget > 0 and len(lengths) < cfg.max_num_seqs:
        lengths.append(min(budget, max_len))
        budget -= lengths[-1]
    blocks_needed = sum(-(-n // block_size) for n in lengths)
    runner.init_kv_cache(blocks_needed, block_size, capture=False)
    chunks, next_block = [], 0
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        ids = list(range(next_block, next_block + nb))
        next_block += nb
        chunks.append(ScheduledChunk(f"profile-{i}", [1] * n, 0, ids))
    new = [NewRequestData(c.request_id, [1], SamplingParams(temperature=1.0)) for c in chunks]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    runner.execute(StepInput(0, chunks, new, [], sum(lengths)))
    runner.execute(StepInput(1, [], [], [c.request_id for c in chunks], 0))
    logits = torch.empty(cfg.max_num_seqs, runner.info.vocab_size, device=runner.device)
    torch.softmax(logits, -1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    profile_kv = blocks_needed * per_block
    runner.free_kv_cache()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    other = total - free - torch.cuda.memory_reserved()
    graph_reserve = 0 if cfg.enforce_eager else 512 * (1 << 20)
    available = total * cfg.gpu_memory_utilization - (peak - profile_kv) - other
    available -= graph_reserve
    runner.memory.update(
        activations_gib=(peak - profile_kv) / GiB - runner.memory.get("weights_gib", 0.0),
        other_gib=other / GiB,
        total_gib=total / GiB,
    )
    if available < per_block * -(-max_len // block_size):
        raise RuntimeError(
            f"not enough GPU memory for the KV cache: {available / GiB:.2f} GiB left after "
            f"weights and activations ({peak / GiB:.2f} GiB peak) at "
            f"gpu_memory_utilization={cfg.gpu_memory_utilization}; raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens / max_model_len"
        )
    return int(available // per_block)
