"""All-reduce latency per message size: NCCL (eager and inside a CUDA graph) against
the one-shot and two-shot all-reduce of ``torch.distributed._symmetric_memory``.

``python -m tokenloom.bench.allreduce --ranks 2 --out allreduce.json`` on a host with
two GPUs (one process per GPU). The decode all-reduces are small (batch x hidden x 2
bytes: 8 KiB at batch 1 of a 4096-wide model), where latency, not bandwidth, decides;
the result names the largest size up to which symmetric memory beat NCCL (the
threshold tensor parallelism would switch at). ``--device cpu`` runs the NCCL column
over gloo on the CPU, a check of the harness only.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from datetime import timedelta
from typing import Any

from tokenloom.plugins.models.cuda_timing import median_cuda_us

DEFAULT_SIZES_KIB = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _world_name() -> Any:
    import torch.distributed as dist

    world = dist.group.WORLD
    assert world is not None, "init_process_group first"
    return world.group_name


def _time_host(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters * 1e6


def _graphed(fn: Any) -> Any:
    """``fn`` captured into a CUDA graph (10 calls per replay, to amortise the launch)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return graph.replay


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size)
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    symm = None
    if cuda and not args.no_symm:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
            symm_mem.enable_symm_mem_for_group(_world_name())
    rows = []
    for kib in args.sizes_kib:
        numel = kib * 1024 // torch.empty((), dtype=dtype).element_size()
        rows.append(_measure(kib, numel, dtype, device, rank, size, symm, args.iters))
        dist.barrier()
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _measure(
    kib: int, numel: int, dtype: Any, device: Any, rank: int, size: int, symm: Any, iters: int
) -> dict[str, Any]:
    """One message size: each method eager and, on CUDA, replayed from a CUDA graph."""
    import torch
    import torch.distributed as dist

    x = torch.ones(numel, dtype=dtype, device=device)
    methods: dict[str, Any] = {
        "nccl" if device.type == "cuda" else "gloo": lambda: dist.all_reduce(x)
    }
    row: dict[str, Any] = {"kib": kib}
    if symm is not None:
        group_name = _world_name()
        buf = symm.empty(numel, dtype=dtype, device=device)
        symm.rendezvous(buf, group_name)
        buf.fill_(rank + 1)
        one = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        row["symm_correct"] = bool((one.float() == size * (size + 1) / 2).all().item())
        methods["symm_one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(
            buf, "sum", group_name
        )
        methods["symm_two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(
            buf, "sum", group_name
        )
    for name, fn in methods.items():
        if device.type != "cuda":
            row[f"{name}_us"] = _time_host(fn, iters)
            continue
        row[f"{name}_us"] = median_cuda_us(fn, iters)
        try:
            row[f"{name}_graph_us"] = median_cuda_us(_graphed(fn), iters) / 10
        except Exception as exc:  # a method that cannot be captured is reported, not fatal
            row[f"{name}_graph_error"] = repr(exc)[:200]
    return row


def threshold_kib(rows: list[dict[str, Any]]) -> int:
    """The largest size up to which symmetric memory (one- or two-shot) beat NCCL in a
    graph at every size; 0 when it never did."""
    best = 0
    for row in rows:
        symm = min(
            row.get("symm_one_shot_us", float("inf")), row.get("symm_two_shot_us", float("inf"))
        )
        if symm < row.get("nccl_graph_us", float("inf")) and row.get("symm_correct", False):
            best = row["kib"]
        else:
            break
    return best


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(
        prog="python -m tokenloom.bench.allreduce", description=__doc__
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=DEFAULT_SIZES_KIB)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-symm", action="store_true", help="NCCL only")
    parser.add_argument("--out", default="allreduce.json")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    result = {"ranks": args.ranks, "device": args.device, "rows": rows}
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["symm_threshold_kib"] = threshold_kib(rows)
    for row in rows:
        print(
            "  ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    if "symm_threshold_kib" in result:
        print(f"symmetric memory faster up to {result['symm_threshold_kib']} KiB")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
