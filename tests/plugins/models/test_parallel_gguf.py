"""A GGUF checkpoint at tensor_parallel_size=2 (gloo, CPU): rank 0 converts it into the
cache before the worker starts, both ranks read their shards of the one converted
file, and the greedy tokens equal TP=1's."""

from __future__ import annotations

import pytest
from gguf_files import greedy_tokens, write_gguf

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models.gguf.checkpoint import cache_root

pytestmark = pytest.mark.slow


def test_q8_gguf_at_tp2_gives_tp1_tokens_from_one_converted_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    hf = write_tiny_model(tmp_path / "hf", "qwen2", num_heads=4, num_kv_heads=2)
    model = tmp_path / "gguf"
    model.mkdir()
    write_gguf(hf, model / "tiny-Q8_0.gguf", "Q8_0")

    parallel = greedy_tokens(model, tensor_parallel_size=2)
    converted = sorted(cache_root().rglob("*.safetensors"))
    single = greedy_tokens(model)

    assert parallel == single
    assert len(converted) == 1 and converted[0].name == "model.float32.safetensors"
