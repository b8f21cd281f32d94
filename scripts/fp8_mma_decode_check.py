# Session 28: decode_fp8_mma (interpreter) against the dequantized reference and the shipped kernel; TERN=1: q exactly representable in e4m3, so only the rounding of P is left.
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import gather_kv, write_kv_cache
from tokenloom.plugins.attention.triton_kernels.decode_fp8_mma import decode_fp8_mma
from tokenloom.plugins.attention.triton_kernels.decode import decode_attention

torch.manual_seed(0)
B, H, HKV, D, PAGE = 3, 8, 2, 64, 16
seq_lens = torch.tensor([37, 130, 5], dtype=torch.int32)
nblocks = 40
pool, caches = kv_quant.allocate(1, nblocks, PAGE, HKV, D, torch.float8_e4m3fn, torch.device("cpu"))
kc, vc = caches[0]
tables = torch.zeros(B, 10, dtype=torch.int32)
perm = torch.randperm(nblocks)
n = 0
for b in range(B):
    for j in range((int(seq_lens[b]) + PAGE - 1) // PAGE):
        tables[b, j] = perm[n]; n += 1
    L = int(seq_lens[b])
    k = torch.randn(L, HKV, D) * 2; v = torch.randn(L, HKV, D)
    slots = torch.tensor([int(tables[b, t // PAGE]) * PAGE + t % PAGE for t in range(L)])
    write_kv_cache(k, v, kc, vc, slots)
q = torch.randint(-1, 2, (B, H, D)).half() if os.environ.get("TERN") else torch.randn(B, H, D).half()
scale = D ** -0.5
def ref():
    outs = []
    for b in range(B):
        L = int(seq_lens[b])
        keys = gather_kv(kc, tables[b], L).float().repeat_interleave(H // HKV, 1)
        vals = gather_kv(vc, tables[b], L).float().repeat_interleave(H // HKV, 1)
        s = torch.einsum("hd,shd->hs", q[b].float(), keys) * scale
        outs.append(torch.einsum("hs,shd->hd", s.softmax(-1), vals))
    return torch.stack(outs)
expected = ref()
for splits, bn in ((1, 64), (4, 32), (3, 16)):
    out = torch.zeros(B, H, D, dtype=torch.half)
    part_out = torch.zeros(B * H * splits * D); part_lse = torch.zeros(B * H * splits); cnt = torch.zeros(B * HKV, dtype=torch.int32)
    decode_fp8_mma(q, kc, vc, tables, seq_lens, out, part_out, part_lse, cnt, scale, splits, block_n=bn)
    o2 = torch.zeros(B, H, D, dtype=torch.half)
    decode_attention(q, kc, vc, tables, seq_lens, o2, part_out, part_lse, cnt, scale, splits, bn)
    err = (out.float() - expected).abs().max().item(); err2 = (o2.float() - expected).abs().max().item()
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    print(f"splits {splits} block_n {bn}: max err {err:.4f} (shipped {err2:.4f}), rel {rel:.4f}, counters zero {bool((cnt == 0).all())}")
