"""The fused Gumbel-max sampler against the unfused draw, and its tiling (issue 16).

For each batch size, at a 128,256-token vocabulary: the unfused draw (softmax, noise,
divide, argmax: what ``Sampler._draw`` runs) and ``fused_sample`` at several programs per
SM and block sizes; medians of 50 timed calls (CUDA events, after a warm-up), with the
GB/s of logits read. Prints a table and writes JSON to $OUT/sample_bench.json.

    python scripts/gpu/sample_bench.py [--batches 1,8,32,128,256]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from tokenloom.plugins.executor.sampling import fused_sample as fused
from tokenloom.plugins.executor.sampling.logits_filters import exponential_race
from tokenloom.plugins.models.cuda_timing import median_cuda_us

VOCAB = 128_256


def bench_batch(batch: int, sms: int) -> dict:
    logits = torch.randn(batch, VOCAB, device="cuda")
    temperature = torch.ones(batch, device="cuda")
    seed = fused.host_seed()
    row: dict = {"batch": batch}

    def unfused() -> torch.Tensor:
        probs = (logits / temperature.view(-1, 1)).softmax(dim=-1)
        return exponential_race(probs, torch.empty_like(probs).exponential_())

    def fused_call(splits: int | None = None, block: int = fused.DEFAULT_BLOCK) -> torch.Tensor:
        return fused.fused_sample(logits, temperature, seed, num_splits=splits, block=block)

    row["unfused_us"] = median_cuda_us(unfused, iters=50)
    for per_sm in (4, 8, 16):
        for block in (1024, 2048):
            splits = max(1, min(-(-VOCAB // block), -(-per_sm * sms // batch)))
            row[f"fused_{per_sm}_{block}_us"] = median_cuda_us(
                functools.partial(fused_call, splits, block), iters=50
            )
    # the kernels alone, without the host's launch cost: 20 calls in one CUDA graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fused_call()
    row["fused_default_graph_us"] = median_cuda_us(graph.replay, iters=20) / 20
    # greedy rows: torch's argmax against the kernel's (session 20), kernels alone
    for name, fn in (
        ("torch", lambda: logits.argmax(dim=-1)),
        ("greedy", lambda: fused.greedy_argmax(logits)),
    ):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
        row[f"argmax_{name}_graph_us"] = median_cuda_us(g.replay, iters=20) / 20
    print(
        f"B={batch:4d}: argmax torch {row['argmax_torch_graph_us']:6.1f} us, "
        f"greedy kernel {row['argmax_greedy_graph_us']:6.1f} us",
        flush=True,
    )
    best = min((v, k) for k, v in row.items() if k.startswith("fused_") and "graph" not in k)
    row["best"] = best[1]
    print(
        f"B={batch:4d}: unfused {row['unfused_us']:7.1f} us; fused default "
        f"{row['fused_4_1024_us']:7.1f} us (kernels alone {row['fused_default_graph_us']:6.1f}"
        f" us, {batch * VOCAB * 4 / row['fused_default_graph_us'] / 1e3:5.0f} GB/s); best "
        f"{best[1]} {best[0]:7.1f} us",
        flush=True,
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,128,256")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [bench_batch(int(b), sms) for b in args.batches.split(",")]
    if "OUT" in os.environ:
        with open(os.path.join(os.environ["OUT"], "sample_bench.json"), "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
