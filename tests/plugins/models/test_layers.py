"""The building blocks: rope settings in both config layouts, rope scaling, the
rotary rotation itself, and RMSNorm's fused residual add."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.plugins.models.layers import Linear, RMSNorm
from tokenloom.plugins.models.rope import (
    RotaryEmbedding,
    apply_rotary,
    rope_inv_freq,
    rope_parameters,
)

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_rope_parameters_read_transformers4_and_transformers5_layouts_alike():
    old = rope_parameters({"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING})
    new = rope_parameters({"rope_parameters": {**LLAMA31_SCALING, "rope_theta": 500000.0}})
    assert old == new
    assert old["rope_theta"] == 500000.0 and old["rope_type"] == "llama3"


def test_rope_parameters_default_to_plain_rope_with_theta_10000():
    assert rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope_parameters({"rope_scaling": {"type": "linear", "factor": 2.0}})["rope_type"] == (
        "linear"
    )


def test_unsupported_rope_type_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        rope_parameters({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_llama3_scaling_slows_long_wavelengths_and_keeps_short_ones():
    plain = rope_inv_freq(16, {"rope_type": "default", "rope_theta": 500000.0})
    scaled = rope_inv_freq(16, {**LLAMA31_SCALING, "rope_theta": 500000.0})
    wavelen = 2 * math.pi / plain
    short = wavelen < 64 / 4  # below high_freq_wavelen
    long = wavelen > 64 / 1  # above low_freq_wavelen
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    between = ~short & ~long
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all()


def test_linear_scaling_divides_every_frequency_by_the_factor():
    plain = rope_inv_freq(8, {"rope_type": "default", "rope_theta": 10000.0})
    linear = rope_inv_freq(8, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    torch.testing.assert_close(linear, plain / 4.0)


def test_rotary_is_identity_at_position_zero_and_preserves_norms():
    rope = RotaryEmbedding(8, 32, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    q0, k0 = apply_rotary(q, k, *rope(torch.zeros(3, dtype=torch.int64)))
    torch.testing.assert_close(q0, q)
    torch.testing.assert_close(k0, k)
    q5, _ = apply_rotary(q, k, *rope(torch.full((3,), 5, dtype=torch.int64)))
    assert not torch.allclose(q5, q)
    torch.testing.assert_close(q5.norm(dim=-1), q.norm(dim=-1))


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8, 64, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(q_pos: int, k_pos: int) -> float:
        rq, _ = apply_rotary(q, k, *rope(torch.tensor([q_pos])))
        _, rk = apply_rotary(q, k, *rope(torch.tensor([k_pos])))
        return (rq * rk).sum().item()

    assert score(10, 7) == pytest.approx(score(40, 37), rel=1e-5)


def test_rmsnorm_add_and_norm_returns_the_sum_and_its_norm():
    norm = RMSNorm(6, 1e-6, torch.float32)
    norm.weight.data.fill_(2.0)
    x, residual = torch.randn(4, 6), torch.randn(4, 6)
    normed, summed = norm.add_and_norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    expected = 2.0 * summed / summed.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(normed, expected)


def test_merged_linear_slots_cover_disjoint_consecutive_rows():
    linear = Linear(4, (6, 2, 2), bias=True, dtype=torch.float32)
    slots = linear.slots(["q_proj", "k_proj", "v_proj"])
    assert [(s.start, s.stop) for s in slots.values()] == [
        (0, 6),
        (0, 6),
        (6, 8),
        (6, 8),
        (8, 10),
        (8, 10),
    ]
    assert slots["k_proj.weight"].target().shape == (2, 4)
    assert slots["v_proj.bias"].target().shape == (2,)
