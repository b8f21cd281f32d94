"""The merged q/k/v projection's one-row int4 GEMV with the rotation and the cache stores
in its epilogue (``int4_qkv_rope``) equals, to the bit, the same GEMV then the rope
kernel (``rope_ops.qk_norm_rope_`` writing the cache): the indexing of head pairs, the
rounding, the slots. In the interpreter on the CPU (fp32, fp16), its PTX on the GPU at
the Llama-3-8B shape (bf16)."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemv_h2 import _x
from test_int4_gemv_nk import CUDA, DEVICE, DTYPES, _layer

from tokenloom.plugins.models import rope_ops
from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_fused, launch_int4_nk
from tokenloom.plugins.quant.kernels.int4_qkv_rope import rope_fits
from tokenloom.protocols.components.quant import QkvRope


def _rope(dtype, hq, hkv, d, slot, seed=0):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, d // 2, generator=gen) * 6.0
    table = torch.stack((angles.cos(), angles.sin()), dim=1).to(DEVICE, dtype)  # [1, 2, D/2]
    k_cache = torch.zeros(4, 4, hkv, d, dtype=dtype, device=DEVICE)
    slots = torch.tensor([slot], dtype=torch.int64, device=DEVICE)
    cos, sin = table[:, 0], table[:, 1]  # strided views, as RotaryEmbedding hands them out
    return QkvRope(cos, sin, hq, hkv, d, k_cache, torch.zeros_like(k_cache), slots)


def _unfused(x, layer, group, bias, tiling, dp4a, rope):
    """The GEMV, then the rope kernel rotating q and k in place and writing the cache."""
    qweight, scales, zeros = layer
    block_n, block_k, warps = tiling
    y = launch_int4_nk(x, qweight, scales, zeros, group, bias, block_n, block_k, warps, dp4a)
    return (y, *rope_kernel(y, rope))


def rope_kernel(y, rope):
    """The rope kernel on a q/k/v GEMV's output ``y``: q and k rotated in place, k and v
    written into fresh caches, returned ``(k_cache, v_cache)``."""
    hq, hkv, d = rope.num_q_heads, rope.num_kv_heads, rope.head_dim
    q, k, v = y.split((hq * d, hkv * d, hkv * d), dim=1)
    k_cache, v_cache = torch.zeros_like(rope.k_cache), torch.zeros_like(rope.v_cache)
    rope_ops.qk_norm_rope_(
        q.view(1, hq, d), k.view(1, hkv, d), rope.cos.unsqueeze(1), rope.sin.unsqueeze(1),
        kv_write=(v.view(1, hkv, d), k_cache, v_cache, rope.slot_mapping),
    )  # fmt: skip
    return k_cache, v_cache


def _check(x, layer, group, bias, tiling, dp4a, rope):
    qweight, scales, zeros = layer
    block_n, block_k, warps = tiling
    assert rope_fits(x, qweight.shape[1], block_n, rope)
    y = launch_int4_nk(
        x, qweight, scales, zeros, group, bias, block_n, block_k, warps, dp4a, rope=rope
    )
    expected, k_cache, v_cache = _unfused(x, layer, group, bias, tiling, dp4a, rope)
    assert torch.equal(y, expected)
    assert torch.equal(rope.k_cache, k_cache) and torch.equal(rope.v_cache, v_cache)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [(16, 128, 4), (32, 256, 4), (16, 1024, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_epilogue_equals_the_gemv_then_the_rope_kernel(dtype, tiling, bias):
    hq, hkv, d, k = 4, 2, 32, 256  # a pair block of 4-16 rows: 1-4 programs a head
    qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
    x = _x(k, dtype)
    b = torch.randn((hq + 2 * hkv) * d).to(DEVICE, dtype) if bias else None
    rope = _rope(dtype, hq, hkv, d, slot=6)
    y = _check(x, (qweight, scales, zeros), 128, b, tiling, False, rope)
    flat_k = rope.k_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[6], y[0, hq * d : (hq + hkv) * d].view(hkv, d))  # rotated k
    assert not flat_k[:6].any() and not flat_k[7:].any()  # only the token's slot
    assert torch.equal(rope.v_cache.view(-1, hkv, d)[6], y[0, (hq + hkv) * d :].view(hkv, d))


def test_a_padding_slot_stores_nothing_and_the_outputs_still_rotate():
    hq, hkv, d, k = 2, 1, 16, 128
    qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
    rope = _rope(DTYPES[0], hq, hkv, d, slot=-1)
    _check(_x(k, DTYPES[0]), (qweight, scales, zeros), 128, None, (16, 128, 4), False, rope)
    assert not rope.k_cache.any() and not rope.v_cache.any()


def test_it_serves_only_the_calls_it_fits(monkeypatch):
    hq, hkv, d, k = 4, 2, 32, 256
    qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
    x, rope = _x(k, DTYPES[0]), _rope(DTYPES[0], hq, hkv, d, slot=0)
    n = qweight.shape[1]
    assert rope_fits(x, n, 16, rope) and rope_fits(x, n, 32, rope)
    assert not rope_fits(x, n, 64, rope)  # 32 pairs a program: more than a head's 16
    assert not rope_fits(x, n, 8, rope)  # runs of 4 rows: another accumulator layout
    assert not rope_fits(x, n - d, 16, rope)  # rows that are not the heads'
    wide = QkvRope(
        rope.cos, rope.sin, hq + 1, hkv, d, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    assert not rope_fits(x, n, 16, wide)
    nk = GemmConfig(1, 16, 256, 1, 4, 3, nk=True)
    args = (x, qweight, scales, zeros, 128, None)
    monkeypatch.delenv("TOKENLOOM_INT4_FUSED_ROPE", raising=False)
    assert int4_nk_fused(*args, nk, rope=rope) is not None  # on by default (session 25)
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_ROPE", "1")
    assert int4_nk_fused(*args, nk, rope=rope) is not None
    assert (
        int4_nk_fused(*args, GemmConfig(1, 16, 256, 1, 4, 3, nk=True, mma=True), rope=rope) is None
    )
    assert int4_nk_fused(*args, GemmConfig(1, 16, 256, 1, 4, 3), rope=rope) is None  # not nk
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_ROPE", "0")
    assert int4_nk_fused(*args, nk, rope=rope) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("tiling"), [(16, 4096, 4), (32, 4096, 4), (16, 2048, 2), (16, 1024, 4)])
@pytest.mark.parametrize("dp4a", [False, True])
def test_gpu_the_epilogue_at_llama_3_8b_equals_the_unfused_path(tiling, dp4a):
    hq, hkv, d, k = 32, 8, 128, 4096
    qweight, scales, zeros, _ = _layer((hq + 2 * hkv) * d, k)
    rope = _rope(torch.bfloat16, hq, hkv, d, slot=9)
    _check(_x(k, torch.bfloat16, 3e3), (qweight, scales, zeros), 128, None, tiling, dp4a, rope)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_an_int4_llama_decodes_the_same_tokens_with_the_epilogue(
    int4_llama_tokens, monkeypatch, eager
):
    # eager: every q/k/v layer's one-row tiling forced to int4_gemv_nk (16 x 1024 / 4, dp4a),
    # so the epilogue runs whatever the tuner chose; graphs: as tuned, captured
    from tokenloom.plugins.quant.kernels import int4_gemv_nk

    fused: list[bool] = []
    original = int4_gemv_nk.int4_nk_fused

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        y = original(*args, **kwargs)
        if kwargs.get("rope") is not None:
            fused.append(y is not None)
        return y

    monkeypatch.setattr(int4_gemv_nk, "int4_nk_fused", counting)
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_ROPE", "1")
    with_epilogue = int4_llama_tokens(eager, "qkv_proj")
    assert any(fused)  # the epilogue ran (eager) or was captured (graphs)
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_ROPE", "0")
    assert int4_llama_tokens(eager, "qkv_proj") == with_epilogue
