"""The decode kernel with the rotary embedding (and Qwen3's per-head norm) inside it,
storing the new keys/values itself, equals the rope kernel followed by attention
(interpreter on the CPU, native on the GPU)."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_batch, model_info, relative_error

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.plugins.models import rope_ops
from tokenloom.protocols.components.attention import RopeInputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rope_inputs(batch, qk_norm: bool, seed: int = 1) -> RopeInputs:
    gen = torch.Generator().manual_seed(seed)
    tokens, _, head_dim = batch.q.shape
    positions = torch.randint(0, 4000, (tokens,), generator=gen).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(positions, inv_freq)[:, None, :]  # [T, 1, D/2]
    dtype = batch.q.dtype
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    if not qk_norm:
        return RopeInputs(cos, sin)
    q_w, k_w = ((1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2))
    return RopeInputs(cos, sin, q_w.to(DEVICE), k_w.to(DEVICE), 1e-6)


def run(batch, rope: RopeInputs, **settings):
    head_dim = batch.q.shape[-1]
    attn = TritonAttention(
        EngineConfig(), model_info(4, 2, head_dim, batch.q.dtype, DEVICE), **settings
    )
    k_cache, v_cache = batch.clone_caches()
    q, k = batch.q.clone(), batch.k.clone()
    attn.prepare(batch.meta)
    out = attn.forward(q, k, batch.v, k_cache, v_cache, batch.meta, batch.scale, rope=rope)
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    ("seq_lens", "padding_rows"),
    [([5, 40, 17], 0), ([130], 0), ([33, 1], 2)],  # 130 tokens: three splits, the last writes
)
def test_rope_in_the_decode_kernel_equals_the_rope_kernel_then_attention(
    dtype, qk_norm, seq_lens, padding_rows, monkeypatch
):
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype,
        device=DEVICE, padding_rows=padding_rows,
    )  # fmt: skip
    rope = rope_inputs(batch, qk_norm)
    calls = []
    real = rope_ops.qk_norm_rope_
    monkeypatch.setattr(rope_ops, "qk_norm_rope_", lambda *a: calls.append(1) or real(*a))

    out, k_cache, v_cache = run(batch, rope, decode_rope_min_batch=1)  # in the decode kernel
    assert not calls
    expected, k_ref, v_ref = run(batch, rope, decode_rope_min_batch=1000)  # a rope kernel first
    assert calls == [1]

    real_rows = len(seq_lens)
    assert relative_error(out[:real_rows], expected[:real_rows].double().cpu()) < TOLERANCE[dtype]
    assert torch.equal(v_cache, v_ref)  # values stored as they came
    if DEVICE == "cpu":
        assert torch.equal(k_cache, k_ref)  # the same arithmetic on the same values
    else:  # a reduction order may differ between the two kernels' layouts
        torch.testing.assert_close(k_cache, k_ref, rtol=1e-2, atol=1e-2)
    assert not torch.equal(k_cache, batch.k_cache)  # the new keys were written
    if padding_rows:
        assert (out[real_rows:] == 0).all()


def test_mixed_batches_fall_back_to_the_rope_kernel(monkeypatch):
    batch = make_batch([1, 3], [9, 20], num_heads=4, num_kv_heads=2, head_dim=32, device=DEVICE)
    calls = []
    real = rope_ops.qk_norm_rope_
    monkeypatch.setattr(rope_ops, "qk_norm_rope_", lambda *a: calls.append(1) or real(*a))
    rope = rope_inputs(batch, True)
    out, k_cache, v_cache = run(batch, rope, decode_rope_min_batch=1)
    assert calls == [1]
    # the same as a model that rotates q and k itself and hands them over
    attn = TritonAttention(EngineConfig(), model_info(4, 2, 32, batch.q.dtype, DEVICE))
    q, k = batch.q.clone(), batch.k.clone()
    real(q, k, *rope.as_tuple())
    k_ref, v_ref = batch.clone_caches()
    attn.prepare(batch.meta)
    expected = attn.forward(q, k, batch.v, k_ref, v_ref, batch.meta, batch.scale)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_decode_batches_below_the_minimum_take_the_rope_kernel(monkeypatch):
    batch = make_batch([1, 1], [9, 20], num_heads=4, num_kv_heads=2, head_dim=32, device=DEVICE)
    calls = []
    real = rope_ops.qk_norm_rope_
    monkeypatch.setattr(rope_ops, "qk_norm_rope_", lambda *a: calls.append(1) or real(*a))
    run(batch, rope_inputs(batch, False), decode_rope_min_batch=3)
    assert calls == [1]
    run(batch, rope_inputs(batch, False), decode_rope_min_batch=2)
    assert calls == [1]


def test_heads_below_32_take_the_rope_kernel(monkeypatch):
    """A 16-wide head would give the kernel's half-head ``tl.dot`` K = 8, which the GPU
    compiler refuses (K >= 16; the interpreter accepts it): a 16-wide model's decode
    graphs from 64 rows up failed to compile on the H200 (the quant engine test)."""
    batch = make_batch([1, 1], [9, 20], num_heads=4, num_kv_heads=2, head_dim=16, device=DEVICE)
    calls = []
    real = rope_ops.qk_norm_rope_
    monkeypatch.setattr(rope_ops, "qk_norm_rope_", lambda *a: calls.append(1) or real(*a))
    out, _, _ = run(batch, rope_inputs(batch, False), decode_rope_min_batch=1)
    assert calls == [1]
    assert torch.isfinite(out[:2]).all()
