"""A tensor-parallel group over ``torch.distributed``: gloo on the CPU, NCCL on CUDA.

``DistributedGroup`` is the ``plugins.models.parallel.ParallelGroup`` the layers call
(all-reduce after row-parallel layers and the vocab-parallel embedding, all-gather of
the LM head's logits). ``join`` makes this process one rank of the group through a
``TCPStore`` that rank 0 hosts; the same code runs on every rank.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from tokenloom.config import EngineConfig
from tokenloom.plugins.executor.parallel.symmetric import SymmetricAllReduce
from tokenloom.plugins.models.parallel import ParallelGroup

STORE_HOST = "127.0.0.1"


class DistributedGroup(ParallelGroup):
    """Rank ``rank`` of ``size`` in the default ``torch.distributed`` process group."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self.rank = rank
        self.size = size
        self.backend = backend
        # Opt-in one-shot all-reduce for small messages (``symmetric.enable``).
        self.symmetric: SymmetricAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        symmetric = self.symmetric
        if symmetric is not None and x.numel() <= symmetric.max_numel:
            return symmetric(x)
        dist.all_reduce(x)  # in place; NCCL's is captured into CUDA graphs
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        if self.backend == "nccl":
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (start-up only: KV pool sizes)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the others pass as many placeholders)."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def choose_backend(config: EngineConfig) -> str:
    """``distributed_backend``, where auto is NCCL on CUDA when every rank has its own
    GPU, else gloo (NCCL refuses two ranks on one GPU; gloo takes CUDA tensors)."""
    wanted = config.distributed_backend
    size = config.tensor_parallel_size
    on_cuda = config.device == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    if wanted == "auto":
        return "nccl" if on_cuda and gpus >= size else "gloo"
    if wanted == "nccl" and (not on_cuda or gpus < size):
        raise ValueError(
            f"distributed_backend: nccl needs one GPU per rank ({size} ranks, {gpus} GPUs); "
            "use distributed_backend = gloo"
        )
    return wanted


def rank_config(config: EngineConfig, backend: str) -> EngineConfig:
    """The config every rank runs with. On CUDA over gloo (ranks sharing a GPU, the
    one-GPU check) the decode graphs are off (gloo's collectives cannot be captured);
    ranks sharing a GPU split ``gpu_memory_utilization`` between them."""
    if config.device != "cuda":
        return config
    changes: dict[str, object] = {}
    if backend == "gloo" and not config.enforce_eager:
        changes["enforce_eager"] = True
    per_gpu = -(-config.tensor_parallel_size // max(1, torch.cuda.device_count()))
    if per_gpu > 1:
        changes["gpu_memory_utilization"] = config.gpu_memory_utilization / per_gpu
    return msgspec.structs.replace(config, **changes) if changes else config


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` (wrapping round when there are fewer GPUs
    than ranks, e.g. every rank on the one GPU) or the CPU."""
    if config.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(config.device)


def share_cpu(config: EngineConfig) -> int:
    """On the CPU, give each rank its share of the cores: with every rank on torch's
    default (all cores), the ranks' OpenMP threads spin against each other and a tiny
    matmul takes tens of milliseconds instead of microseconds. Returns the thread count
    before (to restore at shutdown)."""
    before = torch.get_num_threads()
    if config.device == "cpu":
        import os

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    return before


def free_port() -> int:
    with socket.socket() as s:
        s.bind((STORE_HOST, 0))
        return int(s.getsockname()[1])


def open_store(port: int, rank: int, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store; the other ranks connect to it."""
    return dist.TCPStore(
        STORE_HOST,
        port,
        size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join(
    store: dist.TCPStore, rank: int, size: int, backend: str, timeout_s: float
) -> DistributedGroup:
    """Join the default process group as ``rank`` (blocks until every rank joined)."""
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    return DistributedGroup(rank, size, backend)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
