"""Quality of a quantized KV cache on the built-in real model (SmolLM2-135M), on the
CPU reference path (torch attention, fp32): the perplexity of the eval text may rise
by at most 1% over the recorded fp32 reference (issue #12). Golden-set agreement is
measured with ``tokenloom eval`` and reported in docs/quantization.md (the full set
takes about a minute per config, too long for CI)."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM
from tokenloom.checkpoints.default_model import builtin_gguf_path
from tokenloom.eval import GOLDEN_PATH, TEXT_PATH
from tokenloom.eval.golden import load_golden
from tokenloom.eval.perplexity import load_passages, measure_perplexity

BUILTIN = builtin_gguf_path()
pytestmark = pytest.mark.skipif(BUILTIN is None, reason="the built-in model is not installed")
MAX_INCREASE = 0.01


@pytest.fixture()
def one_thread():
    # As ``tokenloom eval``: small batches gain little from more CPU threads and lose
    # several times over when other processes keep the cores busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_perplexity_rises_at_most_one_percent_with_a_quantized_kv_cache(kv_cache_dtype, one_thread):
    reference = load_golden(GOLDEN_PATH)
    assert reference.perplexity is not None
    assert (reference.config["dtype"], reference.config["attention"]) == ("float32", "torch")
    llm = LLM(
        model=str(BUILTIN),
        device="cpu",
        dtype="float32",
        attention="torch",
        kv_cache_dtype=kv_cache_dtype,
    )
    try:
        result = measure_perplexity(llm, load_passages(TEXT_PATH))
    finally:
        llm.engine.shutdown()
    increase = result.perplexity / reference.perplexity - 1
    print(f"kv_cache_dtype={kv_cache_dtype}: perplexity {result.perplexity:.4f} ({increase:+.2%})")
    assert result.num_tokens == reference.num_text_tokens
    assert increase <= MAX_INCREASE
    assert abs(increase) > 1e-5  # the cache really was quantized: the figure moved
