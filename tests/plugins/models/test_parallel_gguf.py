"""A GGUF checkpoint at tensor_parallel_size=2 (gloo, CPU): rank 0 converts it into the
cache before the worker starts, both ranks read their shards of the one converted
file, and the greedy tokens equal TP=1's."""

from __future__ import annotations

import pytest
from gguf_files import write_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models.gguf.checkpoint import cache_root

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 33, 2, 99, 250, 7], [400, 12, 8, 8, 301, 77, 45, 9, 600, 3, 14, 111]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_blocks": 64}


def _generate(model, **options):
    llm = LLM(str(model), **ENGINE, **options)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_q8_gguf_at_tp2_gives_tp1_tokens_from_one_converted_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    hf = write_tiny_model(tmp_path / "hf", "qwen2", num_heads=4, num_kv_heads=2)
    model = tmp_path / "gguf"
    model.mkdir()
    write_gguf(hf, model / "tiny-Q8_0.gguf", "Q8_0")

    parallel = _generate(model, tensor_parallel_size=2)
    converted = sorted(cache_root().rglob("*.safetensors"))
    single = _generate(model)

    assert parallel == single
    assert len(converted) == 1 and converted[0].name == "model.float32.safetensors"
