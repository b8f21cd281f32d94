"""``decode_fp8_mma`` (V transposed per page) compiled for sm_90 offline: instructions per
KV byte of its hottest loop (Triton 3.6 on the path; ``scripts/sass_loop.py``), and how
Triton pipelined its K/V copies: the buffers of K and V^T in shared memory, and the
copy groups the main loop's wait leaves in flight (0: a program never loads while it
computes; its next tile's copies are issued after the tile's products).

    python scripts/fp8_mma_decode_sass.py [BLOCK_N,WARPS,STAGES[,META_AHEAD[,MAXNREG[,FOLD[,PAGE]]]]] ...

Session 35 (Triton 3.6): 128,4,2 (the default) has 2 buffers and 0 in flight, as have 3
and 4 stages; 5 stages give 3 buffers with a tile in flight. META_AHEAD=1 (the block
numbers loaded a tile ahead) gives that from 3 stages.
"""

import collections
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loop import compile_sm90, hottest_loop  # noqa: E402

from tokenloom.plugins.attention.triton_kernels.decode_fp8_mma import (  # noqa: E402
    _decode_fp8_mma_kernel as kernel,
)

PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32",
        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}  # fmt: skip
STRIDES = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_bt",
           "stride_cache_block", "stride_cache_tok", "stride_cache_head", "stride_scale_block"]  # fmt: skip


def main() -> None:
    sig = dict(PTRS)
    sig.update({name: "i32" for name in STRIDES})
    sig.update({"scale_log2": "fp32", "num_splits": "i32", "min_split": "i32"})
    divisible = list(PTRS) + [name for name in STRIDES if name != "stride_bt"]
    ttgir = os.path.join(tempfile.mkdtemp(), "kernel.ttgir")
    os.environ["TTGIR"] = ttgir  # compile_sm90 writes Triton's IR there
    for spec in sys.argv[1:] or ["128,4,2", "64,4,2", "128,8,2"]:
        block_n, warps, stages, ahead, maxnreg, fold, page = (
            [*map(int, spec.split(",")), 0, 0, 0, 0]
        )[:7]
        os.environ.pop("MAXNREG", None)
        if maxnreg:
            os.environ["MAXNREG"] = str(maxnreg)
        consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_H=16,
                      BLOCK_N=block_n, PAGE_SIZE=page or 16, HEADS_FIRST=True, USE_PDL=True,
                      META_AHEAD=bool(ahead), FOLD=bool(fold))  # fmt: skip
        sass, res, shared = compile_sm90(kernel, sig, consts, divisible, warps, stages)
        with open(ttgir) as f:
            ir = f.read()
        buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+xf8", ir)
        start = ir.index("scf.for")  # the main loop's body: to its first yield
        loop = ir[start : ir.index("scf.yield", start)]
        in_flight = re.search(r"async_wait [^{]*\{num = (\d+)", loop)
        loop = hottest_loop(sass)
        ops = collections.Counter(op for _, op in loop)
        regs = res.split("REG:")[1].split()[0]
        spills = sum(1 for line in sass.splitlines() if " STL" in line or " LDL" in line)
        per_byte = len(loop) * 32 * warps / (block_n * 128 * 2)
        mma = {k: v for k, v in ops.items() if "MMA" in k}
        bars = sum(n for op, n in ops.items() if op.startswith("BAR"))
        # plain global loads in the loop (block numbers): their latency is exposed when the
        # pipeliner issues them in the iteration that uses them (session 38's ncu samples)
        ldg = sum(n for op, n in ops.items() if op.startswith("LDG."))
        print(f"BLOCK_N {block_n}, {warps} warps, {stages} stages, META_AHEAD {ahead}, "
              f"MAXNREG {maxnreg or '-'}, FOLD {fold}, PAGE {page or 16}: {per_byte:.2f} per KV byte, "
              f"{bars} barriers, {ldg} global loads, {regs} registers, "
              f"{spills} spill instructions, {shared} B shared, {mma}; K/V buffers "
              f"{'/'.join(buffers)}, copy groups in flight at the loop's wait "
              f"{in_flight.group(1) if in_flight else '-'}")  # fmt: skip
        print("   ", " ".join(f"{k}:{v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main()
