"""The reference backend against a dense float64 attention, and its KV writes."""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import torch_backend
from tokenloom.plugins.attention.torch_backend import TorchAttention

FP32_TOLERANCE = 1e-5


def run(batch, num_heads=4, num_kv_heads=2, head_dim=32):
    backend = TorchAttention(
        EngineConfig(), model_info(num_heads, num_kv_heads, head_dim, torch.float32, "cpu")
    )
    return backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_decode_matches_dense_reference_for_every_gqa_group(num_kv_heads):
    batch = make_batch([1, 1, 1, 1], [1, 16, 17, 70], num_kv_heads=num_kv_heads)
    out = run(batch, num_kv_heads=num_kv_heads)
    assert relative_error(out, dense_reference(batch)) < FP32_TOLERANCE


def test_prefill_without_cache_matches_dense_reference():
    batch = make_batch([5, 33], [5, 33])
    assert relative_error(run(batch), dense_reference(batch)) < FP32_TOLERANCE


def test_chunked_prefill_over_cached_prefix_matches_dense_reference():
    batch = make_batch([7, 20], [40, 20 + 16])
    assert relative_error(run(batch), dense_reference(batch)) < FP32_TOLERANCE


def test_mixed_batch_of_decodes_and_prefills_matches_dense_reference():
    batch = make_batch([1, 9, 1, 4], [30, 9, 3, 50])
    assert relative_error(run(batch), dense_reference(batch)) < FP32_TOLERANCE


def test_a_decode_row_is_computed_alone_whatever_the_batch():
    """Decode rows of one length attend in one call; each row's result is the one it
    gets alone or beside any other rows, bit for bit (a sample does not depend on
    what else the engine runs)."""
    seq_lens = [40, 40, 40, 17]
    batch = make_batch([1] * 4, seq_lens)
    backend = TorchAttention(EngineConfig(), model_info(4, 2, 32, torch.float32, "cpu"))
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    assert relative_error(out, dense_reference(batch)) < FP32_TOLERANCE
    tables = batch.meta.block_tables
    for rows in ([0], [1], [2], [0, 2], [2, 1], [3]):
        seq_len = seq_lens[rows[0]]
        alone = backend._decode(
            batch.q[rows], batch.k_cache, batch.v_cache, tables[rows], seq_len, batch.scale
        )
        assert torch.equal(alone, out[rows]), rows


def test_new_keys_and_values_land_in_their_slots():
    batch = make_batch([3, 1], [19, 5])
    run(batch)
    flat_k = batch.k_cache.flatten(0, 1)
    flat_v = batch.v_cache.flatten(0, 1)
    slots = batch.meta.slot_mapping
    assert torch.equal(flat_k[slots], batch.k)
    assert torch.equal(flat_v[slots], batch.v)


def test_padding_rows_write_nothing_and_give_zeros():
    batch = make_batch([1, 1], [9, 24], padding_rows=2)
    k_before, v_before = batch.clone_caches()
    out = run(batch)
    real = batch.meta.slot_mapping[:2]
    changed = (batch.k_cache != k_before).flatten(0, 1).any(-1).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(real.tolist())
    assert torch.equal(batch.v_cache.flatten(0, 1)[real], batch.v[:2])
    untouched = torch.ones(v_before.shape[0] * v_before.shape[1], dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(batch.v_cache.flatten(0, 1)[untouched], v_before.flatten(0, 1)[untouched])
    assert torch.all(out[2:] == 0)
    assert relative_error(out[:2], dense_reference(batch)) < FP32_TOLERANCE


def test_plugin_registers_torch_attention_component():
    (spec,) = torch_backend.tokenloom_register_components()
    assert (spec.kind, spec.name, spec.factory) == ("attention", "torch", TorchAttention)
