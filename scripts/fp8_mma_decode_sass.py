# Session 28: decode_fp8_mma compiled for sm_90 offline (PYTHONPATH with triton 3.6), instructions per KV byte.
import sys, collections
sys.path.insert(0, "/work/main/scripts")
from sass_loop import compile_sm90, hottest_loop
from tokenloom.plugins.attention.triton_kernels.decode_fp8_mma import _decode_fp8_mma_kernel as K
sig = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32",
       "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
       "counters_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
strides = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_bt", "stride_cache_block",
           "stride_cache_tok", "stride_cache_head", "stride_scale_block"]
sig.update({n: "i32" for n in strides}); sig.update({"scale_log2": "fp32", "num_splits": "i32", "min_split": "i32"})
for bn in (64, 128):
    consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=bn,
                  PAGE_SIZE=16, HEADS_FIRST=True, USE_PDL=True)
    div = [n for n in sig if n.endswith("_ptr")] + [n for n in strides if n != "stride_bt"]
    sass, res, shared = compile_sm90(K, sig, consts, div, 4, 2)
    loop = hottest_loop(sass); c = collections.Counter(op for _, op in loop)
    regs = res.split("REG:")[1].split()[0]
    print(f"BLOCK_N={bn}: {len(loop)*128/(bn*128*2):.2f} per KV byte, regs {regs}, shared {shared}, MMA { {k:v for k,v in c.items() if 'MMA' in k} }")
    print("   ", " ".join(f"{k}:{v}" for k, v in c.most_common(12)))
