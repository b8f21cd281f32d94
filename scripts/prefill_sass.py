"""The prefill attention kernel (``prefill.py``) compiled for sm_90 offline, over an 8-bit
cache at Llama-3-8B heads with the tiles each cache gets on CUDA (64 x 64, 4 warps; 2
stages for fp8, ``FP8_PREFILL``, 3 for int8, ``cuda_defaults``; bf16 queries): its hottest loop's instructions, its global loads (``LDG``: plain, the pipeliner
leaves them in the loop; ``LDGSTS``: copies to shared memory) and its registers.

    python scripts/prefill_sass.py fp8|int8 PAGE_SIZE AHEAD

Session 53: the int8 prefill's loop (pages of 16, the look-ahead on) held 44 scalar loads,
its scales' one at a time; with the scales head-major (landed in session 55) 12 scalar
and 16 two-wide. Run it with ``PYTHONPATH`` naming another tree's install to compare trees.
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loop import compile_sm90, hottest_loop  # noqa: E402

from tokenloom.plugins.attention.triton_kernels import prefill  # noqa: E402
from tokenloom.plugins.attention.triton_settings import FP8_PREFILL, cuda_defaults  # noqa: E402


def main() -> None:
    kv, page, ahead = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fn = prefill._prefill_kernel
    cache = "*fp8e4nv" if kv == "fp8" else "*i8"
    types = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": "*bf16",
             "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "scale_log2": "fp32"}  # fmt: skip
    fp8 = kv == "fp8"
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, PAGE_SIZE=page,
                  DOT_PRECISION="tf32", KV_QUANT=True, V_T=fp8, KV_F16=fp8,
                  P_LIFT=512.0 if fp8 else 128.0, KV_MMA8=False, AHEAD=bool(ahead))  # fmt: skip
    if "SCALE_RUN" in fn.arg_names:  # a tree with head-major scales (session 55 on)
        consts["SCALE_RUN"] = 16 if page % 16 == 0 else 1
    sig = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
    # pointers and strides divisible by 16 as at Llama-3-8B shapes (not the table's row
    # stride, nor a token-major scale's token stride: the number of KV heads)
    odd = ("stride_bt", "stride_scale_tok")
    divisible = [n for n, t in sig.items() if t.startswith("*") or (n.startswith("stride") and n not in odd)]  # fmt: skip
    tiles = FP8_PREFILL if fp8 else cuda_defaults(128)
    assert tiles["prefill_block_m"] == tiles["prefill_block_n"] == 64
    stages = tiles["prefill_num_stages"]
    sass, res, _ = compile_sm90(fn, sig, consts, divisible, tiles["prefill_num_warps"], stages)
    loop = hottest_loop(sass)
    ops = collections.Counter(op for _, op in loop)
    loads = {op: n for op, n in ops.items() if op.startswith("LDG")}
    regs = res.split("REG:")[1].split()[0]
    print(f"{kv}, pages of {page}, look-ahead {ahead}, {stages} stages: loop {len(loop)} instructions, "
          f"{regs} registers, loads {loads}")  # fmt: skip


if __name__ == "__main__":
    main()
