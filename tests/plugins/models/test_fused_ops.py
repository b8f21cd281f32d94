"""The fused Triton kernels equal the unfused torch layers (run under the Triton
interpreter on the CPU, natively on the GPU)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.models import fused_ops, rope_ops
from tokenloom.plugins.models.layers import RMSNorm
from tokenloom.plugins.models.rope import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, dtype).to("cpu")
    norm.weight.data = torch.rand(dim, dtype=torch.float32).add(0.5).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_the_torch_norm(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(5, 48, dtype=dtype)
    residual = torch.randn(5, 48, dtype=dtype) if with_residual else None
    norm = _norm(48, dtype)
    expected = norm.add_and_norm(x, residual) if residual is not None else (norm(x), x)
    dev = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    out, summed = fused_ops.add_rms_norm(dev(x), dev(norm.weight), 1e-6, dev(residual))
    torch.testing.assert_close(out.cpu(), expected[0], rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(summed.cpu(), expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 40, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = fused_ops.silu_and_mul(gate_up.to(DEVICE)).cpu()
    torch.testing.assert_close(out, expected, rtol=_tol(dtype), atol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_in_an_input_order_is_the_norm_gathered_bit_for_bit(dtype, with_residual):
    # act-order weights keep their inputs permuted: the norm stores its columns so, the
    # same bits as gathering its output (and the residual stream stays in order)
    torch.manual_seed(3)
    x = torch.randn(4, 40, dtype=dtype, device=DEVICE)
    residual = torch.randn(4, 40, dtype=dtype, device=DEVICE) if with_residual else None
    weight = _norm(40, dtype).weight.data.to(DEVICE)
    order = torch.randperm(40, device=DEVICE)
    plain, plain_sum = fused_ops.add_rms_norm(x, weight, 1e-6, residual)
    gathered, summed = fused_ops.add_rms_norm(x, weight, 1e-6, residual, order=order)
    assert isinstance(plain, torch.Tensor) and isinstance(gathered, torch.Tensor)
    assert torch.equal(gathered, plain[:, order])
    assert not torch.equal(gathered, plain)
    assert torch.equal(summed, plain_sum)
    # the torch layer (the CPU path) gathers the same columns
    norm = _norm(40, dtype)
    norm.weight.data = weight.cpu()
    reference = norm(x.cpu() + residual.cpu() if residual is not None else x.cpu())
    torch.testing.assert_close(
        norm(x.cpu() + residual.cpu() if residual is not None else x.cpu(), order.cpu()),
        reference[:, order.cpu()],
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_in_an_input_order_is_its_result_gathered_bit_for_bit(dtype):
    torch.manual_seed(4)
    gate_up = torch.randn(3, 2 * 1500, dtype=dtype, device=DEVICE)  # two column blocks
    order = torch.randperm(1500, device=DEVICE)
    plain = fused_ops.silu_and_mul(gate_up)
    gathered = fused_ops.silu_and_mul(gate_up, order)
    assert torch.equal(gathered, plain[:, order])
    assert not torch.equal(gathered, plain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_columns_is_index_select_bit_for_bit(dtype):
    torch.manual_seed(5)
    x = torch.randn(8, 3000, dtype=dtype, device=DEVICE)[:, :1500]  # a row stride > K
    order = torch.randperm(1500, device=DEVICE)
    assert torch.equal(fused_ops.gather_columns(x, order), x.index_select(-1, order))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_in_place_equals_norm_then_rotary(dtype, with_norm):
    torch.manual_seed(2)
    tokens, hq, hkv, d = 4, 6, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    angles = torch.rand(tokens, 1, d // 2) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_norm, k_norm = _norm(d, dtype), _norm(d, dtype)
    eq, ek = (q_norm(q), k_norm(k)) if with_norm else (q, k)
    eq, ek = apply_rotary(eq, ek, cos, sin)
    qkv_dev = qkv.clone().to(DEVICE)
    q_dev = qkv_dev[:, : hq * d].view(tokens, hq, d)
    k_dev = qkv_dev[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    weights = (q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE)) if with_norm else (None, None)
    rope_ops.qk_norm_rope_(q_dev, k_dev, cos.to(DEVICE), sin.to(DEVICE), *weights, eps=1e-6)
    tol = 4 * _tol(dtype)
    torch.testing.assert_close(q_dev.cpu(), eq, rtol=tol, atol=tol)
    torch.testing.assert_close(k_dev.cpu(), ek, rtol=tol, atol=tol)
    v_before = qkv[:, (hq + hkv) * d :]
    torch.testing.assert_close(qkv_dev[:, (hq + hkv) * d :].cpu(), v_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_can_write_the_rotated_keys_and_values_into_the_paged_cache(dtype):
    torch.manual_seed(3)
    tokens, hq, hkv, d, blocks, bs = 5, 4, 2, 16, 4, 4
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    angles = torch.rand(tokens, 1, d // 2, device=DEVICE) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.zeros(blocks, bs, hkv, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([13, 2, -1, 7, 0], device=DEVICE)  # -1: a padding row, skipped
    rope_ops.qk_norm_rope_(q, k, cos, sin, kv_write=(v, k_cache, v_cache, slots))
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[token])  # the rotated key, as left in qkv
            assert torch.equal(flat_v[slot], v[token])
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    written[[13, 2, 7, 0]] = True
    assert not flat_k[~written.to(DEVICE)].any() and not flat_v[~written.to(DEVICE)].any()
