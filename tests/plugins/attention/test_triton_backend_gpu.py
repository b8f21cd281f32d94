"""The Triton backend on a GPU: Llama-3-8B head shapes in bf16/fp16 against a dense
float64 reference and the torch backend, and decode under CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.plugins.attention.triton_backend import TritonAttention

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make(query_lens, seq_lens, dtype, seed=0):
    return make_batch(
        query_lens, seq_lens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype=dtype, device="cuda", seed=seed,
    )  # fmt: skip


def run_both(batch, dtype):
    info = model_info(HEADS, KV_HEADS, HEAD_DIM, dtype, "cuda")
    k_ref, v_ref = batch.clone_caches()
    attn = TritonAttention(EngineConfig(), info)
    attn.prepare(batch.meta)
    out = attn.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    ref = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, k_ref, v_ref, batch.meta, batch.scale
    )
    torch.cuda.synchronize()
    assert torch.equal(batch.k_cache, k_ref) and torch.equal(batch.v_cache, v_ref)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_at_llama_shapes_matches_references(dtype):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 15, 16, 17, 2048, *torch.randint(1, 3000, (27,), generator=gen).tolist()]
    batch = make([1] * len(seq_lens), seq_lens, dtype)
    out, ref = run_both(batch, dtype)
    dense = dense_reference(batch)
    assert relative_error(out, dense) < TOLERANCE[dtype]
    assert relative_error(out, ref.double().cpu()) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_and_mixed_batches_at_llama_shapes_match_references(dtype):
    batch = make([1, 1, 300, 129, 1, 64, 1, 700], [999, 20, 300, 600, 1000, 64, 37, 1500], dtype)
    out, ref = run_both(batch, dtype)
    assert relative_error(out, dense_reference(batch)) < TOLERANCE[dtype]
    assert relative_error(out, ref.double().cpu()) < 2 * TOLERANCE[dtype]


def test_decode_replayed_from_a_cuda_graph_matches_eager_torch_backend():
    dtype, batch_size, max_blocks, num_blocks = torch.bfloat16, 8, 64, 400
    info = model_info(HEADS, KV_HEADS, HEAD_DIM, dtype, "cuda")
    attn, reference = TritonAttention(EngineConfig(), info), TorchAttention(EngineConfig(), info)
    first = make([1] * batch_size, [5] * batch_size, dtype)
    meta = first.meta
    static = {
        "q": first.q.clone(),
        "k": first.k.clone(),
        "v": first.v.clone(),
        "k_cache": torch.zeros(num_blocks, 16, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"),
        "v_cache": torch.zeros(num_blocks, 16, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"),
        "tables": torch.zeros(batch_size, max_blocks, dtype=torch.int32, device="cuda"),
    }
    meta.block_tables = static["tables"]
    graph_args = (static["q"], static["k"], static["v"], static["k_cache"], static["v_cache"])
    attn.prepare(meta)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.forward(*graph_args, meta, first.scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn.forward(*graph_args, meta, first.scale)

    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        seq_lens = torch.randint(1, 900, (batch_size,), generator=gen).tolist()
        step = make([1] * batch_size, seq_lens, dtype, seed=seed + 10)
        static["q"].copy_(step.q)
        static["k"].copy_(step.k)
        static["v"].copy_(step.v)
        static["k_cache"][: step.k_cache.shape[0]].copy_(step.k_cache)
        static["v_cache"][: step.v_cache.shape[0]].copy_(step.v_cache)
        static["tables"].zero_()
        static["tables"][:, : step.meta.block_tables.shape[1]].copy_(step.meta.block_tables)
        meta.slot_mapping.copy_(step.meta.slot_mapping)
        meta.seq_lens.copy_(step.meta.seq_lens)
        graph.replay()
        expected = reference.forward(
            step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, step.scale
        )
        torch.cuda.synchronize()
        assert relative_error(static_out, dense_reference(step)) < TOLERANCE[dtype]
        assert relative_error(static_out, expected.double().cpu()) < 2 * TOLERANCE[dtype]
        written = static["k_cache"][: step.k_cache.shape[0]]
        assert torch.equal(written, step.k_cache)
