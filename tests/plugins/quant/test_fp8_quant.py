"""The per-token fp8 activation quantization: the one-pass kernel (the default; rows up to
16,384 elements held in registers) gives the two-pass kernel's bits, and the oracle's
scales.
In the interpreter on the CPU (its e4m3 conversion replaced by the GPU's rounding,
``tests/interpreter_e4m3.py``); the GPU test against torch's own e4m3 cast is
``test_gpu_kernels.py::test_fused_per_token_fp8_equals_the_torch_reference``."""

from __future__ import annotations

import os

import pytest
import torch

from tokenloom.plugins.quant.fp8 import quantize_fp8_rows
from tokenloom.plugins.quant.kernels.fp8_quant import ROW_BLOCK_MAX, per_token_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 96), (3, 200), (2, 2500)])
def test_the_one_pass_kernel_gives_the_two_pass_kernel_s_bits(dtype, m, k):
    torch.manual_seed(k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    x[:, 5] *= 40  # an outlier channel
    x[-1] = 0.0  # an all-zero row: the scale's floor
    q1, s1 = per_token_fp8(x, one_pass=True)
    q2, s2 = per_token_fp8(x, one_pass=False)
    assert torch.equal(s1, s2)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    q_ref, s_ref = quantize_fp8_rows(x)
    assert torch.equal(s1, s_ref.to(s1.device))
    # the reference's e4m3 values too (the interpreter's conversion is the GPU's here:
    # tests/interpreter_e4m3.py)
    assert torch.equal(q1.float(), q_ref.to(q1.device).float())


def test_rows_up_to_the_limit_take_the_one_pass_kernel_when_it_is_on(monkeypatch):
    from tokenloom.plugins.quant.kernels.fp8_quant import ONE_PASS

    assert ONE_PASS or os.environ.get("TOKENLOOM_FP8_ONE_PASS") == "0"  # the default
    from tokenloom.plugins.quant.kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "ONE_PASS", True)

    seen = []

    class Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            seen.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(
        fp8_quant, "_per_token_fp8_row_kernel", Spy(fp8_quant._per_token_fp8_row_kernel, "one")
    )
    monkeypatch.setattr(
        fp8_quant, "_per_token_fp8_kernel", Spy(fp8_quant._per_token_fp8_kernel, "two")
    )
    per_token_fp8(torch.randn(1, 64, device=DEVICE))
    per_token_fp8(torch.randn(1, ROW_BLOCK_MAX + 8, device=DEVICE))
    monkeypatch.setattr(fp8_quant, "ONE_PASS", False)  # TOKENLOOM_FP8_ONE_PASS=0
    per_token_fp8(torch.randn(1, 64, device=DEVICE))
    assert seen == ["one", "two", "two"]
