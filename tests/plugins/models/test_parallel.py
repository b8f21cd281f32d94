"""Sharding rules of tensor parallelism, checked in one process: each rank's
parameters are exactly its slice of the checkpoint (read through the loader's
ranges), KV heads are replicated when fewer than ranks, the vocabulary pads to a
multiple of the size, and the named bench shapes split over 2, 4 and 8 ranks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tokenloom.checkpoints.model_shapes import SHAPES
from tokenloom.plugins.models import parallel
from tokenloom.plugins.models.llama import LlamaForCausalLM
from tokenloom.plugins.models.loader import load_model


class RankOf(parallel.ParallelGroup):
    """Rank ``rank`` of ``size``, for building and loading only (no collectives run)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _load_rank(model_dir, rank: int, size: int):
    with parallel.use(RankOf(rank, size)):
        model, _ = load_model(model_dir, torch.float32, "cpu")
    return model


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_each_rank_holds_exactly_its_slice_of_the_checkpoint(tiny_model_factory, num_kv_heads):
    base = tiny_model_factory("qwen2", num_kv_heads=num_kv_heads)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"] + 3  # pads at size 2
    model_dir = tiny_model_factory("qwen2", num_kv_heads=num_kv_heads, vocab_size=vocab)
    full = _checkpoint(model_dir)
    head_dim, size = 16, 2  # hidden 64 / 4 heads
    kv_rows = []
    for rank in range(size):
        model = _load_rank(model_dir, rank, size)
        attn = model.model.layers[1].self_attn
        q_w, k_w, v_w = attn.qkv_proj.weight.split((attn.q_size, attn.kv_size, attn.kv_size), dim=0)
        prefix = "model.layers.1.self_attn"
        assert torch.equal(q_w, full[f"{prefix}.q_proj.weight"].chunk(size)[rank])
        kv_head = rank * num_kv_heads // size if num_kv_heads < size else None
        if kv_head is None:
            expected_k = full[f"{prefix}.k_proj.weight"].chunk(size)[rank]
        else:
            expected_k = full[f"{prefix}.k_proj.weight"][
                kv_head * head_dim : (kv_head + 1) * head_dim
            ]
        assert torch.equal(k_w, expected_k)
        kv_rows.append(k_w)
        q_b = attn.qkv_proj.bias[: attn.q_size]
        assert torch.equal(q_b, full[f"{prefix}.q_proj.bias"].chunk(size)[rank])
        assert torch.equal(
            attn.o_proj.weight, full[f"{prefix}.o_proj.weight"].chunk(size, dim=1)[rank]
        )
        down = model.model.layers[0].mlp.down_proj.weight
        assert torch.equal(
            down, full["model.layers.0.mlp.down_proj.weight"].chunk(size, dim=1)[rank]
        )
        # vocab-parallel embedding: rows of the padded vocabulary; the padding is zero
        embed = model.model.embed_tokens
        start, stop = embed.vocab_range
        assert stop - start == -(-vocab // size)
        real = full["model.embed_tokens.weight"][start:stop]
        assert torch.equal(embed.weight[: len(real)], real)
        assert not embed.weight[len(real) :].any()
        assert (len(real) < stop - start) == (rank == size - 1)
    if num_kv_heads == 1:  # MQA: the one KV head is replicated on both ranks
        assert torch.equal(kv_rows[0], kv_rows[1])


def test_rank_model_info_counts_the_ranks_heads(tiny_model_factory):
    _, info = load_model(tiny_model_factory("llama", num_kv_heads=1), torch.float32, "cpu")
    assert parallel.rank_model_info(info, parallel.SINGLE) is info
    ranked = parallel.rank_model_info(info, RankOf(1, 4))
    assert (ranked.num_heads, ranked.num_kv_heads) == (1, 1)
    assert (ranked.vocab_size, ranked.hidden_size) == (info.vocab_size, info.hidden_size)
    with pytest.raises(ValueError, match="do not split evenly"):
        parallel.rank_model_info(info, RankOf(0, 3))


def _numel(config, rank: int, size: int) -> tuple[int, int]:
    """(all parameters, replicated ones) of ``rank``, built on the meta device."""
    with torch.device("meta"), parallel.use(RankOf(rank, size)):
        model = LlamaForCausalLM(config, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    return total, replicated


@pytest.mark.parametrize(("name", "billions"), [("llama-3-70b", 70.55), ("qwen2.5-32b", 32.76)])
def test_named_shapes_split_over_ranks_without_loss(name, billions):
    config = SHAPES[name]
    whole, norms = _numel(config, 0, 1)
    assert abs(whole / 1e9 - billions) < 0.01
    for size in (2, 4, 8):
        parts = [_numel(config, rank, size) for rank in range(size)]
        assert sum(total - replicated for total, replicated in parts) == whole - norms
        assert all(replicated == norms for _, replicated in parts)
