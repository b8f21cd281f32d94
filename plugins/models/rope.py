"""Rotary position embeddings (rotate-half, GPT-NeoX layout): the settings of a config
in either transformers layout (default, linear and Llama 3.1 scaling), the cos/sin table
and its lookup, and the reference rotation (the CPU path; the GPU's is in the rope and
attention kernels)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding (GPT-NeoX layout) at arbitrary positions.

    The cos/sin table covers ``max_positions`` and is built once, in float32, then
    stored in the model dtype (as transformers casts it before use).
    """

    cos_sin: torch.Tensor  # [P, 2, D/2]: a position's cos then its sin, one row

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_params: dict[str, Any],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope_params)  # [head_dim / 2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        table = torch.stack((freqs.cos(), freqs.sin()), dim=1).to(dtype)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D/2], views of one ``[T, 2, D/2]``
        gather (one kernel a forward pass, not two); shared by every layer."""
        rows = self.cos_sin[positions]
        return rows[:, 0:1], rows[:, 1:2]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, 1, D/2] -> rotated q, k (new tensors)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config in either layout: ``rope_theta`` + ``rope_scaling``
    (transformers 4) or ``rope_parameters`` (transformers 5). Always has
    ``rope_type`` and ``rope_theta``. Raises ValueError for an unsupported type."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", float(hf_config.get("rope_theta", 10000.0)))
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with the config's scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slow down by ``factor``, short ones stay, and the
    band between blends the two smoothly."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)
