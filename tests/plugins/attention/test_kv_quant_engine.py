"""A quantized KV cache through the engine: the pool's dtype and block count and its
start-up log, the refusal of a backend that cannot read it, and the Triton path's
tokens against the torch reference path's over an int8 pool (split from
``test_kv_quant.py``, which tests the kernels and the reference path)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def test_engine_pool_follows_kv_cache_dtype_and_logs_the_block_gain(tiny_model_factory, caplog):
    from tokenloom import LLM, SamplingParams

    model = str(tiny_model_factory("llama"))
    blocks, outputs = {}, {}
    for kv in ("auto", "int8"):
        with caplog.at_level("INFO", logger="tokenloom.executor"):
            # on the CPU, where the budget is what it plans (a GPU run would size its own)
            llm = LLM(model=model, dtype="float32", kv_cache_dtype=kv, kv_cache_memory_gb=0.01,
                      device="cpu")  # fmt: skip
        executor = llm.engine.executor
        blocks[kv] = llm.engine.kv_cache.num_blocks
        assert executor.kv_caches[0][0].dtype == (torch.int8 if kv == "int8" else torch.float32)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outputs[kv] = llm.generate([[5, 6, 7, 8] * 5], greedy, use_tqdm=False)[0]
        llm.engine.shutdown()
    info = executor.info
    plain = (
        2
        * info.num_layers
        * kv_quant.block_bytes(16, info.num_kv_heads, info.head_dim, torch.float32)
    )
    assert blocks["int8"] == int(0.01 * (1 << 30)) // executor.kv_bytes_per_block(16)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(
        plain / executor.kv_bytes_per_block(16), rel=0.01
    )
    assert (
        "int8 with per-token-head scales" in caplog.text and "x the float32 blocks" in caplog.text
    )
    assert len(outputs["int8"].outputs[0].token_ids) == 12


class _PlainOnly:
    """A third-party attention plugin that declares no quantized-KV support."""

    @staticmethod
    @hookimpl
    def tokenloom_register_components():
        class PlainAttention(TorchAttention):
            name = "plain-only"
            supports_quantized_kv = False

        return [ComponentSpec("attention", "plain-only", PlainAttention, "test")]


def test_engine_refuses_a_quantized_cache_for_a_backend_that_cannot_read_it(tiny_model_factory):
    from tokenloom import LLM

    model = str(tiny_model_factory("llama"))
    with pytest.raises(ValueError, match="cannot read a quantized KV cache"):
        LLM(model=model, attention="plain-only", kv_cache_dtype="fp8", plugins=[_PlainOnly])
    # kv_cache_dtype auto: accepted
    llm = LLM(model=model, attention="plain-only", plugins=[_PlainOnly], dtype="float32")
    assert llm.engine.executor.kv_caches[0][0].dtype == torch.float32
    llm.engine.shutdown()


def test_triton_engine_with_an_int8_cache_generates_what_the_reference_does(tiny_model_factory):
    # The whole path through the engine: Triton KV write, prefill and decode kernels
    # over the int8 pool (interpreted on the CPU), against the torch reference path.
    from tokenloom import LLM, SamplingParams

    model = str(tiny_model_factory("llama"))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7]
    tokens = {}
    for attention in ("torch", "triton"):
        llm = LLM(
            model=model,
            dtype="float32",
            attention=attention,
            kv_cache_dtype="int8",
            kv_cache_memory_gb=0.01,
        )
        tokens[attention] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.engine.shutdown()
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["torch"])


def test_an_fp8_cache_s_blocks_of_64_generate_what_blocks_of_16_do(tiny_model_factory):
    # An fp8 cache's default blocks (64 tokens, session 51) through the engine: a prompt
    # that shares 100 tokens with an earlier one (prefix-cache hits in whole blocks: 96
    # tokens in blocks of 16, 64 in blocks of 64), prefills chunked across page edges
    # (48 tokens a step), decodes that cross them. The same tokens as blocks of 16: the
    # attention reads the same values from other pages.
    from tokenloom import LLM, SamplingParams

    model = str(tiny_model_factory("llama"))
    shared = [(7 * i) % 200 + 3 for i in range(150)]
    prompts = [shared + [11, 12, 13], shared[:100] + [21] * 40, [5, 6, 7, 8] * 25]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens, cached = {}, {}
    for block_size in (16, 0):  # 0: the default
        llm = LLM(
            model=model,
            dtype="float32",  # prompt 2's tokens 64-95 are recomputed in other chunks
            kv_cache_dtype="fp8",
            block_size=block_size,
            max_num_batched_tokens=48,
            kv_cache_memory_gb=0.02,
        )
        size = llm.engine.kv_cache.block_size
        outs = llm.generate(prompts[:1], greedy, use_tqdm=False)  # fills the prefix cache
        outs += llm.generate(prompts[1:], greedy, use_tqdm=False)
        llm.engine.shutdown()
        tokens[size] = [o.outputs[0].token_ids for o in outs]
        cached[size] = [o.num_cached_tokens for o in outs]
    assert sorted(tokens) == [16, 64]
    assert cached == {16: [0, 96, 0], 64: [0, 64, 0]}
    assert tokens[64] == tokens[16]
    assert all(len(t) == 40 for t in tokens[16])
