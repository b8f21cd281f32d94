"""Quantized KV cache on a GPU: the Triton write, decode and prefill kernels at
Llama-3-8B head shapes (bf16 queries, fp8 / int8 cache) against the torch reference
path, decode replayed from a CUDA graph, and the built-in model end to end (Triton
attention, fused rope write, CUDA graphs) within 1% of its own bf16 perplexity."""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error
from test_decode_fp8_mma import (
    test_stale_slots_past_a_request_s_end_never_reach_its_output as stale_slots_case,
)
from test_kv_quant import FP8_MMA_AGREEMENT, QUANT_ERROR, assert_same_quantized, quantized_copy

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BF16 = 2e-2  # Triton vs torch over bf16 queries (tests/plugins/attention/test_triton_backend_gpu)
KV_DTYPES = [torch.float8_e4m3fn, torch.int8]
# (cache dtype, decode_fp8_mma, fp8 values transposed): an fp8 cache through both decode
# kernels (the fp8-MMA kernel over the transposed values it asks for; the f16 kernels over
# either layout)
CASES = [
    (torch.float8_e4m3fn, 1, True),
    (torch.float8_e4m3fn, 0, False),
    (torch.float8_e4m3fn, 0, True),
    (torch.int8, 0, False),
]


GRAPH_CASES = [(kv_dtype, 0) for kv_dtype in KV_DTYPES]


def bound(kv_dtype, fp8_mma):
    """Triton vs torch over the same cache: bf16's tolerance, or the fp8 products'."""
    return FP8_MMA_AGREEMENT if kv_dtype == torch.float8_e4m3fn and fp8_mma else 2 * BF16


def make(query_lens, seq_lens, seed=0):
    return make_batch(
        query_lens, seq_lens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype=torch.bfloat16, device="cuda", seed=seed,
    )  # fmt: skip


def run_both(batch, kv_dtype, fp8_mma=0, transposed=False):
    """Full paths: Triton writes and attends over its cache, torch over its own."""
    info = model_info(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=fp8_mma)
    assert attn.fp8_values_transposed == bool(fp8_mma)
    k_cache, v_cache = quantized_copy(batch, kv_dtype, transposed)
    ref_k, ref_v = quantized_copy(batch, kv_dtype)
    attn.prepare(batch.meta)
    out = attn.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale)
    ref = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, batch.scale
    )
    torch.cuda.synchronize()
    assert_same_quantized(k_cache, ref_k, kv_dtype)
    assert_same_quantized(v_cache, ref_v, kv_dtype)
    return out, ref


@pytest.mark.parametrize(("kv_dtype", "fp8_mma", "transposed"), CASES)
def test_decode_over_a_quantized_cache_at_llama_shapes_matches_the_reference(
    kv_dtype, fp8_mma, transposed
):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 15, 16, 17, 2048, *torch.randint(1, 3000, (27,), generator=gen).tolist()]
    batch = make([1] * len(seq_lens), seq_lens)
    out, ref = run_both(batch, kv_dtype, fp8_mma, transposed)
    error = relative_error(out, ref.double().cpu())
    rows = [relative_error(out[i : i + 1], ref[i : i + 1].double().cpu()) for i in range(32)]
    print(f"{kv_dtype} fp8_mma={fp8_mma} transposed={transposed}: {error:.4f} vs the "
          f"reference over the same cache, worst row {max(rows):.4f}")  # fmt: skip
    assert error < bound(kv_dtype, fp8_mma)
    assert max(rows) < 1.5 * bound(kv_dtype, fp8_mma)
    assert relative_error(out, dense_reference(batch)) < QUANT_ERROR[kv_dtype] + bound(
        kv_dtype, fp8_mma
    )


@pytest.mark.parametrize(("kv_dtype", "fp8_mma", "transposed"), CASES)
def test_prefill_and_mixed_batches_over_a_quantized_cache_match_the_reference(
    kv_dtype, fp8_mma, transposed
):
    batch = make([1, 1, 300, 129, 1, 64, 1, 700], [999, 20, 300, 600, 1000, 64, 37, 1500])
    out, ref = run_both(batch, kv_dtype, fp8_mma, transposed)
    assert relative_error(out, ref.double().cpu()) < bound(kv_dtype, fp8_mma)
    assert relative_error(out, dense_reference(batch)) < QUANT_ERROR[kv_dtype] + bound(
        kv_dtype, fp8_mma
    )


@pytest.mark.parametrize(("kv_dtype", "fp8_mma"), [(torch.float8_e4m3fn, 1), *GRAPH_CASES])
def test_quantized_decode_replayed_from_a_cuda_graph_matches_eager(kv_dtype, fp8_mma):
    info = model_info(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=fp8_mma)
    batch = make([1] * 8, [37, 900, 5, 64, 300, 17, 1, 640], seed=3)
    k_cache, v_cache = quantized_copy(batch, kv_dtype, attn.fp8_values_transposed)
    static = (batch.q.clone(), batch.k.clone(), batch.v.clone(), k_cache, v_cache)
    attn.prepare(batch.meta)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.forward(*static, batch.meta, batch.scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn.forward(*static, batch.meta, batch.scale)
    for seed in range(3):
        step = make([1] * 8, [37, 900, 5, 64, 300, 17, 1, 640], seed=seed + 10)
        for buffer, new in zip(static[:3], (step.q, step.k, step.v), strict=True):
            buffer.copy_(new)
        graph.replay()
        written = [c.view(torch.uint8).clone() for c in (k_cache, v_cache)]
        written += [kv_quant.scales_of(c).clone() for c in (k_cache, v_cache)]
        expected = attn.forward(*static, batch.meta, batch.scale)  # eager, same writes
        torch.cuda.synchronize()
        assert torch.equal(static_out, expected)
        again = [c.view(torch.uint8) for c in (k_cache, v_cache)]
        again += [kv_quant.scales_of(c) for c in (k_cache, v_cache)]
        assert all(torch.equal(a, b) for a, b in zip(written, again, strict=True))
        assert torch.isfinite(static_out).all() and static_out.abs().sum() > 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_ptx_conversion_of_every_8_bit_value_is_exact(kv_dtype):
    """The decode kernel's PTX helpers (``_kv_to_f16`` with ``KV_ASM``) against torch's
    conversion, bit for bit, for all 256 byte values in every position of a pack of 4."""
    import triton
    import triton.language as tl

    from tokenloom.plugins.attention.triton_kernels.decode_tile import _kv_to_f16

    @triton.jit
    def convert(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(y_ptr + offs, _kv_to_f16(tl.load(x_ptr + offs), True))

    raw = torch.arange(256, dtype=torch.uint8, device="cuda")
    raw = torch.stack([raw.roll(shift) for shift in range(16)]).view(64, 64)
    x = raw.view(kv_dtype)
    y = torch.empty(64, 64, dtype=torch.float16, device="cuda")
    convert[(1,)](x, y, N=64)
    expected = x.to(torch.float16)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert int(nan.sum()) == (0 if kv_dtype == torch.int8 else 2 * 16)


def test_cache_views_keep_their_scales_in_the_pool_on_the_gpu():
    pool, caches = kv_quant.allocate(2, 3, 16, 8, 128, torch.int8, torch.device("cuda"))
    k_cache, _ = caches[1]
    kv_quant.scales_of(k_cache)[2, 15, 7] = 3.0
    per_block = kv_quant.block_bytes(16, 8, 128, torch.int8)
    last = pool[1, 0, 2, per_block - 4 :].cpu().view(torch.float32)
    assert float(last) == 3.0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_builtin_model_on_the_gpu_loses_at_most_one_percent_perplexity(kv_cache_dtype):
    from tokenloom import LLM, SamplingParams
    from tokenloom.checkpoints.default_model import builtin_gguf_path
    from tokenloom.eval import TEXT_PATH
    from tokenloom.eval.perplexity import load_passages, measure_perplexity

    model = builtin_gguf_path()
    if model is None:
        pytest.skip("the built-in model is not installed")
    passages = load_passages(TEXT_PATH)
    results = {}
    for kv in ("auto", kv_cache_dtype):
        llm = LLM(model=str(model), kv_cache_dtype=kv, gpu_memory_utilization=0.3)
        assert llm.engine.config.attention in ("auto", "triton")
        results[kv] = measure_perplexity(llm, passages).perplexity
        # decode through CUDA graphs over the quantized cache: a real answer
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        out = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
        assert "Paris" in out
    increase = results[kv_cache_dtype] / results["auto"] - 1
    print(f"{kv_cache_dtype}: perplexity {results[kv_cache_dtype]:.4f} vs {results['auto']:.4f}")
    assert abs(increase) > 1e-5 and increase <= 0.01


def test_stale_nan_slots_never_reach_the_fp8_mma_output_on_the_gpu():
    """The same on the device, where the fp8 products read the NaN byte as NaN natively."""
    stale_slots_case()


def test_an_fp8_cache_takes_its_own_prefill_tiles_unless_a_prefill_tile_key_is_set():
    from tokenloom.plugins.attention.triton_settings import FP8_PREFILL, cuda_defaults

    info = model_info(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    attn = TritonAttention(EngineConfig(), info)
    plain = {key: cuda_defaults(HEAD_DIM)[key] for key in FP8_PREFILL}
    assert attn.resolved.prefill_tiles == {False: plain, True: FP8_PREFILL}
    # any prefill tile key set by the user: every cache takes the settings as given
    chosen = TritonAttention(EngineConfig(), info, prefill_num_warps=4)
    assert chosen.resolved.prefill_tiles[True] == chosen.resolved.prefill_tiles[False]
    assert chosen.resolved.prefill_tiles[True]["prefill_num_warps"] == 4


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_fp8_mma_prefill_at_a_user_s_tiles_matches_the_reference(block_size):
    """``prefill_fp8_mma=1`` as a user sets it: ``FP8_PREFILL``'s 64 x 64 tiles at 2
    stages with the blocks and scales a tile ahead, at Llama-3-8B heads (the CPU tests set
    a 32-token tile key, so they run neither these tiles nor these stages)."""
    from tokenloom.plugins.attention.triton_settings import FP8_PREFILL

    fp8 = torch.float8_e4m3fn
    batch = make_batch(
        [1, 300, 129, 1, 64, 700], [999, 300, 600, 1000, 64, 1500], num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda",
        block_size=block_size,
    )  # fmt: skip
    info = model_info(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    out = {}
    for mma in (0, 1):
        attn = TritonAttention(EngineConfig(block_size=block_size), info, prefill_fp8_mma=mma)
        assert attn.resolved.prefill_tiles[True] == FP8_PREFILL and attn.resolved.prefill_meta_ahead
        assert attn.resolved.prefill_fp8_mma == bool(mma)
        k_cache, v_cache = quantized_copy(batch, fp8, attn.fp8_values_transposed)
        write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
        attn.prepare(batch.meta)
        out[mma] = attn.forward(
            batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale,
            kv_written=True,
        )  # fmt: skip
    ref_k, ref_v = quantized_copy(batch, fp8)
    write_kv_cache(batch.k, batch.v, ref_k, ref_v, batch.meta.slot_mapping)
    ref = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, batch.scale
    )
    torch.cuda.synchronize()
    error = relative_error(out[1], ref.double().cpu())
    print(f"fp8-MMA prefill, pages of {block_size}: {error:.4f} vs the reference")
    assert error < FP8_MMA_AGREEMENT
    prompts = slice(1, 1 + 300 + 129)  # the first two prompts' rows: the prefill kernel's
    assert relative_error(out[1][prompts], out[0][prompts].double().cpu()) > 1e-3


def test_the_fp8_mma_decode_takes_its_own_tiles_unless_one_of_their_keys_is_set():
    from tokenloom.plugins.attention.triton_settings import MMA_DECODE

    info = model_info(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    attn = TritonAttention(EngineConfig(), info)
    assert attn.resolved.mma_decode_block_n == MMA_DECODE["decode_block_n"]
    assert attn.resolved.mma_decode_num_stages == MMA_DECODE["decode_num_stages"]
    assert attn.resolved.mma_decode_maxnreg == MMA_DECODE["decode_maxnreg"]
    assert attn.resolved.mma_decode_meta_ahead
    chosen = TritonAttention(EngineConfig(), info, decode_num_stages=2)
    assert (chosen.resolved.mma_decode_block_n, chosen.resolved.mma_decode_num_stages) == (0, 2)
    assert chosen.resolved.mma_decode_maxnreg == 0
    assert not chosen.resolved.mma_decode_meta_ahead  # the CUDA default without MMA_DECODE's tiles
    # the metadata lookahead alone keeps the tiles
    ahead_off = TritonAttention(EngineConfig(), info, decode_fp8_meta_ahead=0)
    assert ahead_off.resolved.mma_decode_block_n == MMA_DECODE["decode_block_n"]
    assert not ahead_off.resolved.mma_decode_meta_ahead
