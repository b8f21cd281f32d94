"""The one-row GEMVs' L2 prefetch before the PDL wait (``gemv_weights.prefetch_rows_l2``).

Which layers take it (``l2_prefetch``: the narrow ones, under PDL, unless switched off),
that the three kernels that take it compile to L2 prefetches for sm_90 only when asked
(compiled here, no GPU needed), and, on a GPU, that it changes no output bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from tokenloom.plugins.quant.kernels.gemv_weights import PREFETCH_MAX_BYTES, l2_prefetch

KERNELS = ("int8_words", "int8_h2", "int4_h2")


def test_the_narrow_layers_prefetch_under_pdl_unless_switched_off(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_GEMV_PREFETCH", raising=False)
    qkv = torch.empty(4096, 6144, dtype=torch.int8, device="meta")  # 25 MB
    gate_up = torch.empty(4096, 28672, dtype=torch.int8, device="meta")  # 117 MB
    int4_gate_up = torch.empty(512, 28672, dtype=torch.int32, device="meta")  # 59 MB
    assert l2_prefetch(qkv, pdl=True)
    assert not l2_prefetch(gate_up, pdl=True) and not l2_prefetch(int4_gate_up, pdl=True)
    assert not l2_prefetch(qkv, pdl=False)  # nothing runs before a wait that is not there
    edge = torch.empty(PREFETCH_MAX_BYTES // 4, dtype=torch.int32, device="meta")
    assert l2_prefetch(edge, pdl=True)
    assert not l2_prefetch(
        torch.empty(PREFETCH_MAX_BYTES + 1, dtype=torch.int8, device="meta"), pdl=True
    )
    monkeypatch.setenv("TOKENLOOM_GEMV_PREFETCH", "all")
    assert l2_prefetch(gate_up, pdl=True) and not l2_prefetch(gate_up, pdl=False)
    monkeypatch.setenv("TOKENLOOM_GEMV_PREFETCH", "0")
    assert not l2_prefetch(qkv, pdl=True)


def _compile(kernel: str, prefetch: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tokenloom.plugins.quant.kernels import int4_gemv_h2, int8_gemv_h2, weight_gemv

    split = dict(PARTIAL=True, REDUCE=True, SPLIT=4, HAS_BIAS=False, USE_PDL=True)
    if kernel == "int8_words":
        fn = weight_gemv._weight_gemv_kernel
        consts = dict(BITS=8, GROUP=0, HAS_ZEROS=False, BLOCK_N=128, BLOCK_K=128, BIASED=False)
        consts.update(ASM=True, WORDS=True, **split)
        pointers = {"qw_ptr": "i32", "s_ptr": "fp32", "y_ptr": "fp32", "cnt_ptr": "i32"}
    elif kernel == "int8_h2":
        fn = int8_gemv_h2._int8_gemv_h2_kernel
        consts = dict(BLOCK_N=128, BLOCK_K=128, ASM=True, AMAX_BLOCK=1024, **split)
        pointers = {"qw_ptr": "i32", "s_ptr": "fp32", "y_ptr": "fp32", "cnt_ptr": "i32"}
    else:
        fn = int4_gemv_h2._int4_gemv_h2_kernel
        consts = dict(GROUP=128, BLOCK_N=128, BLOCK_K=128, ASM=True, AMAX_BLOCK=1024, GUARD=True)
        consts.update(split)
        pointers = {"qw_ptr": "i32", "y_ptr": "fp32", "cnt_ptr": "i32"}
    consts["PREFETCH"] = prefetch
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "bf16")
        else:
            signature[name] = "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.fixture(scope="module")
def prefetches() -> dict[str, list[int]]:
    """Per kernel, the L2 prefetches in its sm_90 PTX without and with ``PREFETCH``. In a
    subprocess: the tests run under TRITON_INTERPRET=1 (interpreted functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernels_compile_to_l2_prefetches_only_when_asked(prefetches, kernel):
    without, with_ = prefetches[kernel]
    assert without == 0 and with_ > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("h2", [False, True])
@pytest.mark.parametrize(("n", "k", "split"), [(6144, 4096, 8), (4096, 4096, 16)])
def test_gpu_the_prefetch_changes_no_output_bit(monkeypatch, bits, h2, n, k, split):
    from tokenloom.plugins.models.pdl import pdl_on
    from tokenloom.plugins.quant.int4 import quantize_int4
    from tokenloom.plugins.quant.int8 import quantize_int8
    from tokenloom.plugins.quant.kernels import gemv_weights
    from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

    if bits == 4 and not h2:
        pytest.skip("int4's fp32 GEMV takes no prefetch")
    if not pdl_on(torch.device("cuda")):
        pytest.skip("no PDL on this GPU: no wait to prefetch before")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.02).cuda()
    x = torch.randn(1, k, generator=gen).cuda().bfloat16()
    if bits == 8:
        qweight, scales = quantize_int8(w)
        zeros, group = None, 0
    else:
        qweight, scales, zeros = quantize_int4(w.bfloat16(), 128)
        group = 128
    asked = []
    real = gemv_weights.l2_prefetch

    def spy(qw, pdl):
        asked.append(real(qw, pdl))
        return asked[-1]

    for module in ("weight_gemv", "int8_gemv_h2", "int4_gemv_h2"):
        monkeypatch.setattr(f"tokenloom.plugins.quant.kernels.{module}.l2_prefetch", spy)
    cfg = GemmConfig(1, 128, 128, split, 4, 3, h2=h2)
    outputs = []
    for switch in ("0", "1"):
        monkeypatch.setenv("TOKENLOOM_GEMV_PREFETCH", switch)
        outputs.append(weight_gemm(x, qweight, scales, zeros, bits, group, None, cfg))
    assert asked == [False, True]  # the kernel took the switch both times
    assert torch.equal(outputs[0], outputs[1])


if __name__ == "__main__":
    print(
        json.dumps(
            {
                k: [_compile(k, p).count("prefetch.global.L2") for p in (False, True)]
                for k in KERNELS
            }
        )
    )
