"""The fp8 activation quantization folded into the kernel before the projection (the
add+RMSNorm, SiLU-and-mul): ``Fp8Rows`` bit for bit what ``per_token_fp8`` makes of the
16-bit result, and the decoder hands them over exactly where the projection takes them.

In the interpreter on the CPU (e4m3 conversions as the GPU's: ``tests/interpreter_e4m3.py``)
and natively on the GPU, where an fp8 model's greedy tokens with and without the fold are
compared too."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.models import fused_gemv, fused_ops
from tokenloom.plugins.models.layers import Linear, RMSNorm
from tokenloom.plugins.quant.kernels.fp8_quant import per_token_fp8
from tokenloom.protocols.components.quant import Fp8Rows, LinearKernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def _same_rows(got: Fp8Rows, x: torch.Tensor) -> None:
    """``got`` holds ``per_token_fp8(x)``'s bits (scales and e4m3 bytes) and ``x``'s dtype."""
    q, scales = per_token_fp8(x)
    assert got.dtype == x.dtype and got.q.dtype == torch.float8_e4m3fn
    assert got.q.shape == x.shape and got.scales.shape == (x.shape[0], 1)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("cols", [48, 200])
def test_the_norm_s_fp8_rows_are_the_quantized_norm(dtype, with_residual, cols):
    torch.manual_seed(cols)
    x = torch.randn(5, cols, device=DEVICE).to(dtype)
    x[1, 3] *= 60  # an outlier channel in one row
    residual = torch.randn(5, cols, device=DEVICE).to(dtype) if with_residual else None
    weight = torch.rand(cols, device=DEVICE).add(0.5).to(dtype)
    normed, summed = fused_ops.add_rms_norm(x, weight, 1e-6, residual)
    rows, summed8 = fused_ops.add_rms_norm(x, weight, 1e-6, residual, fp8=True)
    assert isinstance(rows, Fp8Rows) and isinstance(normed, torch.Tensor)
    assert torch.equal(summed8, summed)
    _same_rows(rows, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [40, 1500])
def test_silu_and_mul_s_fp8_rows_are_the_quantized_product(dtype, cols):
    torch.manual_seed(cols)
    gate_up = torch.randn(4, 2 * cols, device=DEVICE).to(dtype)
    gate_up[2] = 0.0  # an all-zero row: the scale's floor
    gate_up[0, cols + 7] *= 50
    _same_rows(fused_ops.silu_and_mul_fp8(gate_up), fused_ops.silu_and_mul(gate_up))


class Fp8Spy(LinearKernel):
    """A dense kernel that takes ``Fp8Rows`` (dequantized, then the matmul) and records
    what each call got."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.calls = weight, []

    def apply(self, x, bias):
        self.calls.append("16-bit")
        return x @ self.weight.t()

    def takes_fp8_rows(self, x):
        return x.dim() == 2

    def apply_fp8_rows(self, x, bias):
        self.calls.append("fp8")
        return ((x.q.float() * x.scales) @ self.weight.float().t()).to(x.dtype)


def _linear(out: int, inp: int, dtype) -> Linear:
    layer = Linear(inp, [out], False, dtype).to(DEVICE)
    layer.weight.data = torch.randn(out, inp, device=DEVICE).to(dtype) / inp**0.5
    layer.kernel = Fp8Spy(layer.weight.data.clone())
    return layer


@pytest.mark.parametrize("fold", ["1", "0", None])  # None: the default, on since session 39
def test_the_layer_hands_fp8_rows_where_the_projections_take_them(fold, monkeypatch):
    if fold is None:
        monkeypatch.delenv("TOKENLOOM_FP8_FOLD_QUANT", raising=False)
    else:
        monkeypatch.setenv("TOKENLOOM_FP8_FOLD_QUANT", fold)
    monkeypatch.setenv("TOKENLOOM_FUSED_NORM_GEMV", "0")
    torch.manual_seed(1)
    dtype, hidden_size, inter = torch.float16, 64, 96
    norm = RMSNorm(hidden_size, 1e-6, dtype).to(DEVICE)
    norm.weight.data = torch.rand(hidden_size, device=DEVICE).add(0.5).to(dtype)
    gate_up, down = _linear(2 * inter, hidden_size, dtype), _linear(hidden_size, inter, dtype)
    hidden = torch.randn(3, hidden_size, device=DEVICE).to(dtype)
    residual = torch.randn(3, hidden_size, device=DEVICE).to(dtype)

    act, summed = fused_gemv.norm_and_project(norm, gate_up, hidden, residual, True, down)
    out = down(act)
    if fold != "0":
        assert isinstance(act, Fp8Rows)
        assert gate_up.kernel.calls == ["fp8"] and down.kernel.calls == ["fp8"]
    else:
        assert isinstance(act, torch.Tensor)
        assert gate_up.kernel.calls == ["16-bit"] and down.kernel.calls == ["16-bit"]
    # against the unfolded kernels, quantized apart as the fp8 kernel would
    normed, expected_sum = fused_ops.add_rms_norm(hidden, norm.weight, 1e-6, residual)
    assert torch.equal(summed, expected_sum)
    if fold != "0":
        q, s = per_token_fp8(normed)
        gu = ((q.float() * s) @ gate_up.kernel.weight.float().t()).to(dtype)
        q, s = per_token_fp8(fused_ops.silu_and_mul(gu))
        expected = ((q.float() * s) @ down.kernel.weight.float().t()).to(dtype)
        assert torch.equal(out, expected)
    # without a taker after it, SiLU-and-mul stays 16-bit (the norm still folds)
    gate_up.kernel.calls.clear()
    act2, _ = fused_gemv.norm_and_project(norm, gate_up, hidden, residual, True, None)
    assert isinstance(act2, torch.Tensor)
    assert gate_up.kernel.calls == (["fp8"] if fold != "0" else ["16-bit"])
    # the first layer (no residual yet): the norm of hidden itself, the stream is hidden
    qkv = _linear(80, hidden_size, dtype)
    y, stream = fused_gemv.norm_and_project(norm, qkv, hidden, None)
    assert stream is hidden and qkv.kernel.calls == (["fp8"] if fold != "0" else ["16-bit"])
    normed0, _ = fused_ops.add_rms_norm(hidden, norm.weight, 1e-6)
    q, s = per_token_fp8(normed0)
    expected0 = ((q.float() * s) @ qkv.kernel.weight.float().t()).to(dtype)
    assert (
        torch.equal(y, expected0)
        if fold != "0"
        else torch.equal(y, normed0 @ qkv.kernel.weight.t())
    )


def test_silu_and_mul_stays_16_bit_where_the_next_layer_declines(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_FP8_FOLD_QUANT", raising=False)
    monkeypatch.setenv("TOKENLOOM_FUSED_NORM_GEMV", "0")
    torch.manual_seed(2)
    dtype = torch.float16
    gate_up, down = _linear(64, 32, dtype), _linear(32, 32, dtype)
    down.kernel.takes_fp8_rows = lambda x: False
    x = torch.randn(2, 32, device=DEVICE).to(dtype)
    act = fused_gemv.project_silu(gate_up, x, down)
    assert isinstance(act, torch.Tensor)
    assert torch.equal(act, fused_ops.silu_and_mul(x @ gate_up.kernel.weight.t()))


@pytest.mark.skipif(DEVICE != "cuda", reason="the fp8 GEMMs need fp8 tensor cores")
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_fp8_kernel_gives_the_same_bits_from_folded_rows(rows):
    from tokenloom.plugins.quant.fp8 import Fp8Kernel, quantize_fp8_rows

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    torch.manual_seed(rows)
    w = torch.randn(512, 256, device="cuda") / 16
    kernel = Fp8Kernel(*quantize_fp8_rows(w))
    x = torch.randn(rows, 256, device="cuda").bfloat16()
    weight = torch.rand(256, device="cuda").add(0.5).bfloat16()
    normed, _ = fused_ops.add_rms_norm(x, weight, 1e-6)
    folded, _ = fused_ops.add_rms_norm(x, weight, 1e-6, fp8=True)
    assert kernel.takes_fp8_rows(normed)
    assert torch.equal(kernel.apply_fp8_rows(folded, None), kernel.apply(normed, None))


@pytest.mark.skipif(DEVICE != "cuda", reason="an fp8 model on the GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_an_fp8_model_s_tokens_are_the_same_with_the_fold(eager, tiny_model_factory, monkeypatch):
    from tokenloom import LLM, SamplingParams

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    model = str(tiny_model_factory("llama", hidden_size=1024, intermediate_size=2048,
                                   num_heads=8, num_kv_heads=2))  # fmt: skip
    calls: list[str] = []
    real = fused_ops.silu_and_mul_fp8
    monkeypatch.setattr(fused_ops, "silu_and_mul_fp8", lambda g: calls.append("fold") or real(g))

    def tokens(fold: str) -> list[list[int]]:
        monkeypatch.setenv("TOKENLOOM_FP8_FOLD_QUANT", fold)
        llm = LLM(model, dtype="bfloat16", device="cuda", quant="fp8", max_num_seqs=4,
                  enforce_eager=eager)  # fmt: skip
        try:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.engine.shutdown()

    off = tokens("0")
    assert not calls
    on = tokens("1")
    assert calls  # the fold ran
    assert on == off
