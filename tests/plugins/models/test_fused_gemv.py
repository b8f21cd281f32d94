"""The one-row GEMV with the residual add, RMSNorm and SiLU folded in equals the
unfused kernels (interpreter on the CPU, native on the GPU), and a model decodes
the same logits with it as without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.models.fused_gemv import norm_and_project, norm_gemv
from tokenloom.plugins.models.layers import Linear, RMSNorm
from tokenloom.plugins.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def unfused(hidden, residual, norm_w, eps, w, bias, silu):
    """In float64: the row, its norm, the projection (and SiLU-and-mul)."""
    x = hidden.double() if residual is None else hidden.double() + residual.double()
    x = x.to(hidden.dtype).double()  # the stored residual is rounded to the model dtype
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
    y = F.linear(normed, w.double(), None if bias is None else bias.double())
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(48, 100), (40, 64), (64, 1536)])
@pytest.mark.parametrize(("has_residual", "bias", "silu"), [
    (True, False, False), (False, False, False), (True, True, False), (True, False, True),
    (False, False, True),
])  # fmt: skip
def test_norm_gemv_equals_the_unfused_kernels(dtype, n, k, has_residual, bias, silu):
    torch.manual_seed(0)
    hidden = torch.randn(1, k, dtype=dtype, device=DEVICE) * 3
    residual = torch.randn(1, k, dtype=dtype, device=DEVICE) if has_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, device=DEVICE)).to(dtype)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    expected, summed = unfused(hidden, residual, norm_w, 1e-5, w, b, silu)
    # N and K not multiples of the tile; K over several tiles (the prefetch's masks)
    for config in [(16, 32, 4), (8, 512, 4)] + ([(4, 1024, 4)] if DEVICE == "cuda" else []):
        y, res = norm_gemv(hidden, residual, norm_w, 1e-5, w, config, b, silu)
        assert y.shape == (1, n // 2 if silu else n) and y.dtype == dtype
        err = (y.double() - expected).norm() / expected.norm()
        assert err < TOL[dtype], (config, float(err))
        if residual is None:
            assert res is hidden  # the stream starts at the row itself
        else:  # written once, by program 0, exactly as the unfused kernel rounds it
            assert res.data_ptr() not in (hidden.data_ptr(), residual.data_ptr())
            assert torch.equal(res.double(), summed)


def test_norm_and_project_takes_the_fused_kernel_only_for_one_row_with_a_gemv(monkeypatch):
    from tokenloom.plugins.models import fused_gemv

    torch.manual_seed(0)
    linear = Linear(32, (16, 16), False, torch.float32).to(DEVICE)
    torch.nn.init.normal_(linear.weight)
    norm = RMSNorm(32, 1e-6, torch.float32).to(DEVICE)
    torch.nn.init.normal_(norm.weight)
    calls = []
    real = fused_gemv.norm_gemv
    monkeypatch.setattr(fused_gemv, "norm_gemv", lambda *a: calls.append(1) or real(*a))
    one, res = torch.randn(1, 32, device=DEVICE), torch.randn(1, 32, device=DEVICE)

    linear.fused = (8, 32, 4)
    fused = norm_and_project(norm, linear, one, res, silu=True)
    norm_and_project(norm, linear, torch.randn(3, 32, device=DEVICE), None)  # 3 rows
    monkeypatch.setenv("TOKENLOOM_FUSED_NORM_GEMV", "0")
    norm_and_project(norm, linear, one, res, silu=True)
    monkeypatch.delenv("TOKENLOOM_FUSED_NORM_GEMV")
    linear.fused = None
    plain = norm_and_project(norm, linear, one, res, silu=True)

    assert calls == [1]
    assert torch.allclose(fused[0], plain[0], atol=1e-5) and torch.equal(fused[1], plain[1])


def _decode_logits(model, info, fused: bool, monkeypatch, paged_runner) -> torch.Tensor:
    monkeypatch.setenv("TOKENLOOM_FUSED_NORM_GEMV", "1" if fused else "0")
    runner = paged_runner(model, info, 1)
    runner.step([(0, [5, 17, 33, 2])])  # prefill: several rows, never fused
    return torch.cat([runner.step([(0, [t])]) for t in (99, 250, 7)])  # one-row decode


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_model_decodes_the_same_logits_with_the_fused_norms(
    arch, tiny_model_factory, monkeypatch, paged_runner
):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model, info = load_model(tiny_model_factory(arch), dtype, DEVICE)
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemv = module.fused = (8, 64, 4)
    from tokenloom.plugins.models import fused_gemv

    calls = []
    real = fused_gemv.norm_gemv
    monkeypatch.setattr(fused_gemv, "norm_gemv", lambda *a: calls.append(1) or real(*a))
    plain = _decode_logits(model, info, False, monkeypatch, paged_runner)
    assert not calls
    fused = _decode_logits(model, info, True, monkeypatch, paged_runner)
    assert len(calls) == 3 * 2 * info.num_layers  # both norms of every layer, each decode step
    tol = 1e-4 if dtype == torch.float32 else 0.03
    assert (fused - plain).abs().max().item() < tol * plain.abs().max().item()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_the_fused_gemv_is_never_chosen_off_the_gpu():
    from tokenloom.plugins.models.skinny_dispatch import SkinnyDispatch

    w = torch.randn(16, 32, dtype=torch.bfloat16)  # a tunable dtype: only the device rules it out
    assert SkinnyDispatch().choose_fused(w, (8, 512, 4), False) is None


@pytest.mark.parametrize(("silu", "bias"), [(False, False), (True, False), (False, True)])
def test_the_fused_config_must_beat_the_unfused_kernels_by_three_percent(silu, bias):
    from tokenloom.plugins.models import fused_gemv

    torch.manual_seed(0)
    w = torch.randn(32, 64, device=DEVICE) / 8
    configs = fused_gemv.FUSED_CONFIGS
    # the unfused pair first, then each config: the third is fastest, the fifth next
    times = iter([10.0, 9.9, 9.8, 9.0, 10.5, 9.5] + [11.0] * (len(configs) - 5))
    b = torch.randn(32, device=DEVICE) if bias else None  # wrong unless both sides add it
    timer = lambda fn: next(times)  # noqa: E731
    best, unfused, fused = fused_gemv.measure_fused(w, (8, 32, 4), silu, timer, b)
    assert (best, unfused, fused) == (configs[2], 10.0, 9.0)
    times = iter([10.0] + [9.8] * len(configs))  # 2% faster: not enough
    assert fused_gemv.measure_fused(w, (8, 32, 4), silu, timer, b)[0] is None


def test_tune_sets_each_layers_kernels_from_the_dispatch(tiny_model_factory, monkeypatch):
    """``SkinnyDispatch.tune`` asks, per linear layer, for the skinny GEMM, the one-row
    GEMV and (where the model declared it) the folded norm, and for the LM head's GEMV."""
    from tokenloom.plugins.models.layers import Embedding
    from tokenloom.plugins.models.skinny_dispatch import SkinnyDispatch

    model, _ = load_model(tiny_model_factory("qwen3"), torch.float32, "cpu")
    dispatch = SkinnyDispatch()
    monkeypatch.setattr(dispatch, "choose", lambda w: (16, 32, 4, 1))
    monkeypatch.setattr(dispatch, "choose_gemv", lambda w, skinny: (8, 64, 4))
    asked = []
    monkeypatch.setattr(
        dispatch, "choose_fused", lambda w, g, silu, bias: asked.append((silu, bias)) or (16, 64, 4)
    )
    summary = dispatch.tune(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.skinny == (16, 32, 4, 1) and m.gemv == (8, 64, 4) for m in linears)
    fusable = [m for m in linears if m.fusable]
    assert len(fusable) == 2 * len(model.model.layers)  # q/k/v and gate/up of each layer
    assert all(m.fused == (16, 64, 4) for m in fusable)
    assert [silu for silu, _ in asked].count(True) == len(model.model.layers)
    assert all(m.fused is None for m in linears if not m.fusable)  # o_proj, down_proj
    assert isinstance(model.lm_head, Embedding) and model.lm_head.gemv == (8, 64, 4)
    assert f"folded in for {len(fusable)} layers" in summary


def test_a_quantized_gate_up_takes_the_kernels_fused_silu_where_it_offers_it():
    from tokenloom.plugins.models.fused_gemv import project_silu
    from tokenloom.protocols.components.quant import LinearKernel

    torch.manual_seed(0)
    w = torch.randn(8, 6)
    linear = Linear(6, (4, 4), False, torch.float32)
    linear.weight.data = w.clone()
    x = torch.randn(1, 6)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(project_silu(linear, x), F.silu(gate) * up)

    class Plain(LinearKernel):  # the contract's default: no fused SiLU
        def apply(self, x, bias):
            return F.linear(x, 2 * w, bias)

    linear.kernel = Plain()
    gate2, up2 = F.linear(x, 2 * w).chunk(2, dim=-1)
    torch.testing.assert_close(project_silu(linear, x), F.silu(gate2) * up2)

    fused = torch.full((1, 4), 7.0)

    class Fused(Plain):
        def apply_silu_and_mul(self, x, bias):
            return fused

    linear.kernel = Fused()
    assert project_silu(linear, x) is fused
    uneven = Linear(6, (5, 3), False, torch.float32)  # not a gate/up pair: never fused
    uneven.weight.data = w.clone()
    uneven.kernel = Fused()
    gate3, up3 = F.linear(x, 2 * w).chunk(2, dim=-1)
    torch.testing.assert_close(project_silu(uneven, x), F.silu(gate3) * up3)
    hidden, residual = torch.randn(1, 6), torch.randn(1, 6)
    out, stream = norm_and_project(RMSNorm(6, 1e-6, torch.float32), linear, hidden, residual, True)
    assert out is fused
    torch.testing.assert_close(stream, hidden + residual)
