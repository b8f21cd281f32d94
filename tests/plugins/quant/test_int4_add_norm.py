"""The one-row int4 GEMV with the residual add and RMSNorm in its prologue
(``int4_add_norm``) equals the norm, rounded where ``fused_ops.add_rms_norm`` rounds, then
the plain GEMV: with the SiLU and the rope epilogues too, in the interpreter on the CPU
(fp32, fp16) and its PTX on the GPU at the Llama-3-8B shapes (bf16); program 0 stores
the sum; it serves only rows of one tile; an int4 model decodes the same with it."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemv_h2 import _x
from test_int4_gemv_nk import CUDA, DEVICE, DTYPES, _layer
from test_int4_qkv_rope import _rope, _unfused

from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_fused, launch_int4_nk
from tokenloom.protocols.components.quant import AddNorm

EPS = 1e-5


def _add(k, dtype, seed=2):
    gen = torch.Generator().manual_seed(seed)
    residual = (torch.randn(1, k, generator=gen) * 4).to(DEVICE, dtype)
    weight = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, dtype)
    return AddNorm(residual, weight, EPS, torch.full((1, k), float("nan"), dtype=dtype,
                                                     device=DEVICE))  # fmt: skip


def _normed(x, add):
    """``add_rms_norm``'s rounding: the sum, then ``(h inv)`` and ``* w`` each rounded."""
    dt = x.dtype
    h = (x.float() + add.residual.float()).to(dt)
    inv = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + add.eps)
    return ((h.float() * inv).to(dt).float() * add.weight.float()).to(dt), h


def _close(y, expected, dtype):
    # the sum of squares runs in another order: a normed value may move by one ulp
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = (y.float() - expected.float()).abs().max().item()
    assert err <= tol * expected.float().abs().max().item(), err


def _check(n, k, dtype, tiling, bias=None, silu=False, dp4a=False):
    qweight, scales, zeros, _ = _layer(n, k)
    x, add = _x(k, dtype), _add(k, dtype)
    args = (qweight, scales, zeros, 128, bias, *tiling)
    y = launch_int4_nk(x, *args, dp4a, silu=silu, norm=add)
    xn, h = _normed(x, add)
    _close(y, launch_int4_nk(xn, *args, dp4a, silu=silu), dtype)
    assert torch.equal(add.summed, h)
    # a mutation check of the test itself: the raw row gives another result
    assert not torch.allclose(y, launch_int4_nk(x, *args, dp4a, silu=silu), rtol=0.1, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [(16, 256, 4), (8, 1024, 2)])  # K in one tile; wider
@pytest.mark.parametrize("bias", [False, True])
def test_the_prologue_equals_the_norm_then_the_gemv(dtype, tiling, bias):
    b = torch.randn(48).to(DEVICE, dtype) if bias else None
    _check(48, 256, dtype, tiling, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_silu_in_the_epilogue(dtype):
    _check(2 * 40, 256, dtype, (16, 256, 4), silu=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_the_rope_epilogue(dtype):
    hq, hkv, d, k = 4, 2, 32, 256
    qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
    x, add, rope = _x(k, dtype), _add(k, dtype), _rope(dtype, hq, hkv, d, slot=5)
    y = launch_int4_nk(x, qweight, scales, zeros, 128, None, 16, 256, 4, False, rope=rope,
                       norm=add)  # fmt: skip
    xn, h = _normed(x, add)
    expected, k_cache, v_cache = _unfused(xn, (qweight, scales, zeros), 128, None,
                                          (16, 256, 4), False, rope)  # fmt: skip
    _close(y, expected, dtype)
    _close(rope.k_cache, k_cache, dtype)
    _close(rope.v_cache, v_cache, dtype)
    assert rope.k_cache.view(-1, hkv, d)[5].abs().sum() > 0 and torch.equal(add.summed, h)


def test_it_serves_only_rows_of_one_tile(monkeypatch):
    n, k = 48, 256
    qweight, scales, zeros, _ = _layer(2 * n, k)
    dtype = DTYPES[0]
    x, add = _x(k, dtype), _add(k, dtype)
    args = (x, qweight, scales, zeros, 128, None)
    monkeypatch.delenv("TOKENLOOM_INT4_FUSED_NORM", raising=False)
    assert int4_nk_fused(*args, GemmConfig(1, 16, 256, 1, 4, 3, nk=True), silu=True,
                         norm=add) is not None  # fmt: skip
    assert int4_nk_fused(*args, GemmConfig(1, 16, 128, 1, 4, 3, nk=True), silu=True,
                         norm=add) is None  # K over two tiles  # fmt: skip
    aliased = AddNorm(add.residual, add.weight, EPS, add.residual)
    assert int4_nk_fused(*args, GemmConfig(1, 16, 256, 1, 4, 3, nk=True), silu=True,
                         norm=aliased) is None  # in place  # fmt: skip
    for setting, folds in (("gate_up", True), ("qkv", False), ("0", False)):
        monkeypatch.setenv("TOKENLOOM_INT4_FUSED_NORM", setting)
        y = int4_nk_fused(*args, GemmConfig(1, 16, 256, 1, 4, 3, nk=True), silu=True, norm=add)
        assert (y is not None) == folds, setting


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("n", "silu"), [(6144, False), (28672, True)])  # q/k/v, gate/up
@pytest.mark.parametrize("dp4a", [False, True])
def test_gpu_at_llama_3_8b(n, silu, dp4a):
    _check(n, 4096, torch.bfloat16, (16, 4096, 4), silu=silu, dp4a=dp4a)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_an_int4_llama_decodes_the_same_with_the_norms_folded(tiny_model_factory, monkeypatch):
    from tokenloom import LLM, SamplingParams
    from tokenloom.plugins.quant.kernels import int4_gemv_nk

    model = str(tiny_model_factory("llama", hidden_size=1024, intermediate_size=2048,
                                   num_heads=8, num_kv_heads=2))  # fmt: skip
    folded: list[bool] = []
    original = int4_gemv_nk.int4_nk_fused

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        y = original(*args, **kwargs)
        if kwargs.get("norm") is not None:
            folded.append(y is not None)
        return y

    monkeypatch.setattr(int4_gemv_nk, "int4_nk_fused", counting)

    def run() -> list[tuple[list[int], list[float]]]:
        llm = LLM(model, dtype="bfloat16", device="cuda", quant="int4", max_num_seqs=1)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
            outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params, use_tqdm=False)
            done = [(o.outputs[0].token_ids, o.outputs[0].logprobs or []) for o in outs]
            return [(list(t), [lp[tok] for tok, lp in zip(t, lps, strict=True)])
                    for t, lps in done]  # fmt: skip
        finally:
            llm.engine.shutdown()

    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_NORM", "1")
    with_fold = run()
    assert any(folded)  # the norm ran in the GEMV (captured in the decode graphs)
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_NORM", "0")
    folded.clear()
    without = run()
    assert not any(folded)
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(with_fold, without, strict=True):
        for ta, tb, la, lb in zip(tokens_a, tokens_b, lps_a, lps_b, strict=True):
            assert abs(la - lb) < 0.05, (tokens_a, tokens_b)  # a different token: a near tie
            if ta != tb:
                break
