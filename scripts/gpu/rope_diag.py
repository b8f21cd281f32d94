"""Where the int4 q/k/v GEMV's rope epilogue differs from the GEMV then the rope kernel
on the GPU (session 25 diagnostic): per segment (q, k, v), mismatches and the largest
difference; whether its v rows equal the plain GEMV's; whether the caches match.
Run from the repository root on a CUDA machine: python scripts/gpu/rope_diag.py"""

import sys

import torch

sys.path.insert(0, "tests/plugins/quant")
from test_int4_gemv_h2 import _x  # noqa: E402
from test_int4_gemv_nk import _layer  # noqa: E402
from test_int4_qkv_rope import _rope, _unfused  # noqa: E402

from tokenloom.plugins.quant.kernels.int4_gemv_nk import launch_int4_nk  # noqa: E402

hq, hkv, d, k = 32, 8, 128, 4096
qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
x = _x(k, torch.bfloat16, 3e3)
for tiling in [(16, 4096, 4), (32, 4096, 4), (16, 1024, 4)]:
    for dp4a in (False, True):
        rope = _rope(torch.bfloat16, hq, hkv, d, slot=9)
        bn, bk, w = tiling
        y = launch_int4_nk(x, qweight, scales, zeros, 128, None, bn, bk, w, dp4a, rope=rope)
        plain = launch_int4_nk(x, qweight, scales, zeros, 128, None, bn, bk, w, dp4a)
        e, kc, vc = _unfused(x, (qweight, scales, zeros), 128, None, tiling, dp4a, rope)
        torch.cuda.synchronize()
        segs = {
            "q": slice(0, hq * d),
            "k": slice(hq * d, (hq + hkv) * d),
            "v": slice((hq + hkv) * d, None),
        }
        out = [f"{tiling} dp4a={dp4a}"]
        for name, s in segs.items():
            a, b = y[0, s].float(), e[0, s].float()
            bad = (a != b).nonzero().flatten()
            out.append(
                f"{name}: {bad.numel()} bad, max {float((a - b).abs().max()):.3g}"
                + (f" first {bad[:6].tolist()}" if bad.numel() else "")
            )
        out.append(f"plain v == fused v: {torch.equal(plain[0, segs['v']], y[0, segs['v']])}")
        out.append(f"kcache {torch.equal(kc, rope.k_cache)} vcache {torch.equal(vc, rope.v_cache)}")
        print(" | ".join(out), flush=True)
