"""What act-order costs at decode: one Llama-3-8B layer's int4 projections at 1 row,
each with the kernel that feeds it, replayed in a CUDA graph. Three forms a chain:

- ``plain``: weights in order (``Int4Kernel``), the norm or SiLU-and-mul as usual;
- ``index_select``: act-order weights, the input gathered by torch first (session 45's
  ``PermutedInputKernel.apply``);
- ``gather``: the same by ``PermutedInputKernel.apply`` since session 46 (on the GPU
  ``fused_ops.gather_columns``, a PDL kernel that lets the GEMV start during it);
- ``folded``: act-order weights, the norm / SiLU-and-mul storing their columns in the
  weights' input order (``fused_ops``' ``order``, then ``apply_permuted``; session 46).
  o_proj's input comes from the attention, so it has no folded form.

The fused SiLU / rope / norm epilogues of the one-row GEMV are not part of any side.
Prints microseconds per chain and the step's extra over 32 layers.

    PYTHONPATH=... python3 scripts/gpu/act_order_bench.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from tokenloom.plugins.models import fused_ops
from tokenloom.plugins.models.cuda_timing import time_graph
from tokenloom.plugins.quant.common import PermutedInputKernel
from tokenloom.plugins.quant.int4 import Int4Kernel, quantize_int4

HIDDEN, INTER = 4096, 14336
# projection: (N, K, what feeds it: "norm" | "silu" | "attention")
SHAPES = {
    "qkv": (6144, HIDDEN, "norm"),
    "o": (HIDDEN, HIDDEN, "attention"),
    "gate_up": (2 * INTER, HIDDEN, "norm"),
    "down": (HIDDEN, INTER, "silu"),
}


def kernels(n: int, k: int) -> tuple[Int4Kernel, PermutedInputKernel]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qweight, scales, zeros = quantize_int4(w, 128)
    qweight = qweight.t().contiguous().t()  # the row-major storage int4_kernel picks
    kernel = Int4Kernel(qweight, scales, zeros, 128)
    return kernel, PermutedInputKernel(kernel, torch.randperm(k, device="cuda"))


def plain_of(act: PermutedInputKernel) -> Int4Kernel:
    inner = act.inner
    assert isinstance(inner, Int4Kernel)
    return inner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    hidden, residual = torch.randn(1, HIDDEN, **bf16), torch.randn(1, HIDDEN, **bf16)
    norm_w = torch.rand(HIDDEN, **bf16) + 0.5
    gate_up = torch.randn(1, 2 * INTER, **bf16)
    attn_out = torch.randn(1, HIDDEN, **bf16)
    rows = []
    for name, (n, k, feed) in SHAPES.items():
        plain, act = kernels(n, k)
        order = act.input_order
        assert order is not None

        def before(o: torch.Tensor | None = None, f: str = feed) -> torch.Tensor:
            if f == "norm":
                y = fused_ops.add_rms_norm(hidden, norm_w, 1e-5, residual, order=o)[0]
            elif f == "silu":
                y = fused_ops.silu_and_mul(gate_up, o)
            else:
                y = attn_out
            assert isinstance(y, torch.Tensor)
            return y

        row = {
            "projection": name,
            "n": n,
            "k": k,
            "fed_by": feed,
            "plain_us": time_graph(lambda p=plain: p.apply(before(), None), 200, 7),
            "index_select_us": time_graph(
                lambda a=act, o=order: plain_of(a).apply(before().index_select(-1, o), None),
                200,
                7,
            ),
            "gather_us": time_graph(lambda a=act: a.apply(before(), None), 200, 7),
        }
        if feed != "attention":
            row["folded_us"] = time_graph(
                lambda a=act, o=order: a.apply_permuted(before(o), None), 200, 7
            )
            # the folded chain computes what the gathered one does, bit for bit
            assert torch.equal(act.apply_permuted(before(order), None), act.apply(before(), None))
        rows.append(row)
        folded = f"  folded {row['folded_us']:7.2f} us" if "folded_us" in row else ""
        print(
            f"{name:8s} {n:6d} x {k:6d} after {feed:9s} plain {row['plain_us']:7.2f} us"
            f"  index_select {row['index_select_us']:7.2f} us"
            f"  gather {row['gather_us']:7.2f} us{folded}"
        )
    extra = {
        "index_select": sum(r["index_select_us"] - r["plain_us"] for r in rows),
        "gather": sum(r["gather_us"] - r["plain_us"] for r in rows),
        "folded": sum(r.get("folded_us", r["gather_us"]) - r["plain_us"] for r in rows),
    }
    for form, us in extra.items():
        print(f"{form:12s} +{us:6.2f} us a layer over plain, +{32 * us / 1000:.3f} ms a "
              "32-layer decode step")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "extra_us_per_layer": extra}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
