"""``--quant int4`` on a GGUF file whose linears are Q4_0 or Q4_1 keeps the file's own
blocks (``plugins/quant/gguf_int4.py``): the int4 layers dequantize to exactly the
weights the dense load reads (rope permutation undone, merged qkv and gate_up, a
tensor-parallel rank's shard), in groups of 32; other types, or ``gguf_blocks =
false``, are rounded by RTN in groups of 128."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_files import greedy_tokens, write_gguf

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.config import EngineConfig
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.gguf_int4 import BLOCK, block_tensors
from tokenloom.plugins.quant.int4 import GROUP_SIZE, Int4Kernel, Int4Quant, dequantize_int4


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))


def _file(tmp_path, arch: str, qtype: str):
    hf = write_tiny_model(tmp_path / f"hf-{arch}", arch, num_heads=4, num_kv_heads=2)
    return write_gguf(hf, tmp_path / f"{arch}-{qtype}.gguf", qtype)


def _int4_model(path, **plugin):
    method = Int4Quant(EngineConfig(model=str(path), quant="int4", plugin=plugin))
    model, _ = load_model(path, torch.float32, "cpu", prepare=method.prepare_model)
    method.quantize_model(model)
    return model


def _int4_layers(model):
    # the int4 linears (the LM head is int8 by default: its kernel is no Int4Kernel)
    return {
        n: m for n, m in model.named_modules() if isinstance(getattr(m, "kernel", None), Int4Kernel)
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama's Q/K rows are permuted in the file
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_dequantize_to_the_dense_weights(tmp_path, arch, qtype):
    path = _file(tmp_path, arch, qtype)
    dense, _ = load_model(path, torch.float32, "cpu")
    dense_layers = dict(dense.named_modules())
    layers = _int4_layers(_int4_model(path))
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"} <= set(layers)
    for name, layer in layers.items():
        assert layer.kernel.group == BLOCK
        w = dequantize_int4(layer.qweight, layer.scales, layer.qzeros, BLOCK, torch.float32)
        expected = dense_layers[name].weight
        # Q4_0 exactly; Q4_1's (q + m / d) d against d q + m: fp32 rounding
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-6 if qtype == "Q4_1" else 0)


def test_block_tensors_equal_gguf_dequantization_with_flat_blocks():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(6, 128)).astype(np.float32)
    values[2, 32:64] = 0.37  # one value per block: d = 0, w = m
    values[4, 0:32] = 0.0  # d = 0 and m = 0
    for kind in ("Q4_0", "Q4_1"):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        raw = gguf.quants.quantize(values, qtype)
        q, scales, zeros = block_tensors(raw, kind)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        groups = torch.arange(128) // BLOCK
        w = (q.float() - zeros[:, groups]) * scales[:, groups]
        expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)
    assert float(expected[2, 40]) == pytest.approx(0.37, abs=1e-3)


def test_other_types_and_gguf_blocks_false_round_by_rtn(tmp_path):
    q8 = _int4_model(_file(tmp_path, "llama", "Q8_0"))
    assert {layer.kernel.group for layer in _int4_layers(q8).values()} == {GROUP_SIZE}
    rtn = _int4_model(_file(tmp_path, "llama", "Q4_1"), int4={"gguf_blocks": False})
    assert {layer.kernel.group for layer in _int4_layers(rtn).values()} == {GROUP_SIZE}


@pytest.mark.slow
def test_int4_blocks_at_tp2_give_the_dense_models_tokens(tmp_path):
    # each rank reads its shard of the blocks: column-parallel rows, and row-parallel
    # inputs (o_proj and down_proj: 32 of 64 and 64 of 128, whole blocks)
    path = _file(tmp_path, "llama", "Q4_1")
    assert greedy_tokens(path, quant="int4", tensor_parallel_size=2) == greedy_tokens(path)


def test_a_zero_point_that_would_overflow_fp16_becomes_the_block_s_middle():
    from tokenloom.plugins.quant.gguf_int4 import fit_zeros

    values = np.full((2, 64), -0.25, dtype=np.float32)
    values[0, :32] = 0.5 + np.linspace(0, 1e-4, 32)  # d ~ 7e-6: z = -m / d ~ -75,000
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
    q, scales, zeros = block_tensors(raw, "Q4_1")
    assert float(zeros.abs().max()) > torch.finfo(torch.float16).max
    groups = torch.arange(64) // BLOCK
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q2, s2, z2 = fit_zeros(q, scales, zeros, dtype)
        # only fp16 needs it; bf16 and fp32 keep the exact zero point
        assert torch.equal(z2, zeros) == (dtype != torch.float16)
        s2, z2 = s2.to(dtype).float(), z2.to(dtype).float()
        w = (q2.float() - z2[:, groups]) * s2[:, groups]
        assert torch.isfinite(w).all()
        expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
        # fp16 and bf16 round m itself by ~1e-3 and ~4e-3 of it
        torch.testing.assert_close(w, expected, rtol=5e-3, atol=0)
