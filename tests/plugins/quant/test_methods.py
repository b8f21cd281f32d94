"""The weight methods on single layers (CPU reference paths): rounding within half a
step, the packed layouts round-trip, the dense weight is freed, and the quantized
tensors are the layer's parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.config import EngineConfig
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.fp8 import FP8_MAX, Fp8Quant, quantize_fp8_rows
from tokenloom.plugins.quant.int4 import (
    Int4Quant,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from tokenloom.plugins.quant.int8 import Int8Quant, dequantize_int8, quantize_int8

METHODS = {"int8": Int8Quant, "int4": Int4Quant, "fp8": Fp8Quant}


def test_int4_pack_round_trips():
    q = torch.randint(0, 16, (64, 24), dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) & 0xF == int(q[0, 0])  # row 8i+j is nibble j


def test_int8_rounds_each_weight_within_half_a_step():
    w = torch.randn(48, 80)
    qweight, scales = quantize_int8(w)
    assert qweight.dtype == torch.int8 and qweight.shape == (80, 48)
    err = (dequantize_int8(qweight, scales, torch.float32) - w).abs()
    assert bool((err <= scales.t() / 2 + 1e-7).all())
    assert int(qweight.abs().max()) == 127  # each row's largest value is +-127


@pytest.mark.parametrize("k", [256, 320])  # 320: a partial last group of 64
def test_int4_rounds_each_weight_within_half_a_step_of_its_group(k):
    w = torch.randn(40, k)
    qweight, scales, zeros = quantize_int4(w, 128)
    groups = -(-k // 128)
    assert qweight.shape == (k // 8, 40) and scales.shape == zeros.shape == (groups, 40)
    w_hat = dequantize_int4(qweight, scales, zeros, 128, torch.float32)
    step = scales.t().repeat_interleave(128, dim=1)[:, :k]
    assert bool(((w_hat - w).abs() <= step / 2 + 1e-6).all())
    assert bool(((zeros >= 0) & (zeros <= 15) & (zeros == zeros.round())).all())
    w[:, 5] = 0.0  # 0 is a grid point of every group: exact
    w_hat = dequantize_int4(*quantize_int4(w, 128), 128, torch.float32)
    assert bool((w_hat[:, 5] == 0).all())


def test_fp8_scales_each_row_to_the_e4m3_range():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]
    q, scales = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (16, 1)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((16,), FP8_MAX))
    rel = (q.float() * scales - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert float(rel.max()) < 2**-4  # e4m3: 3 mantissa bits


def _layer(n=96, k=256, bias=True):
    torch.manual_seed(0)
    layer = Linear(k, (n // 2, n // 2), bias, torch.float32)
    torch.nn.init.normal_(layer.weight, std=k**-0.5)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    return layer


class _Model(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.proj = layer
        self.lm_head = Linear(layer.out_features, (8,), False, torch.float32)


# relative error of one layer's output: fp8 quantizes the activations too
TOLERANCE = {"int8": 0.01, "fp8": 0.06, "int4": 0.15}


@pytest.mark.parametrize("method", list(METHODS))
def test_method_replaces_the_dense_weight_with_a_kernel(method):
    layer = _layer()
    x = torch.randn(5, 256)
    dense = F.linear(x, layer.weight, layer.bias)
    dense_bytes = layer.weight.numel() * 4
    model = _Model(layer)
    METHODS[method](EngineConfig()).quantize_model(model)
    assert layer.kernel is not None and layer.weight.numel() == 0
    assert model.lm_head.kernel is None and model.lm_head.weight.numel() > 0  # kept dense
    got = layer(x)
    err = float((got - dense).norm() / dense.norm())
    assert 0 < err < TOLERANCE[method]
    stored = sum(p.numel() * p.element_size() for p in layer.parameters()) - 96 * 4  # - bias
    assert stored < dense_bytes / (3.5 if method != "int4" else 6)  # 1 or 1/2 byte + scales


def test_int4_group_size_is_a_plugin_setting():
    from tokenloom.config import ConfigError

    config = EngineConfig(plugin={"int4": {"group_size": 32}})
    layer = _layer(k=256)
    kernel = Int4Quant(config).make_kernel(layer)
    assert kernel.group == 32 and kernel.scales.shape == (256 // 32, 96)
    with pytest.raises(ConfigError, match="group_size"):
        Int4Quant(EngineConfig(plugin={"int4": {"group_size": 12}}))


def test_checkpoint_skip_lists_match_names_modules_and_parts():
    from tokenloom.plugins.quant.common import is_skipped

    parts = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert is_skipped(parts, ["model.layers.0.mlp.gate_proj"])
    assert is_skipped(parts, ["model.layers.0.mlp"])
    assert is_skipped(parts, ["gate_proj"])
    assert not is_skipped(parts, ["model.layers.1.mlp", "down_proj", "lm_head", ""])


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("tied", [False, True])
def test_quant_lm_head_computes_the_logits_from_a_quantized_copy(method, tied, tiny_model_factory):
    from tokenloom import LLM, SamplingParams

    model_dir = tiny_model_factory("llama", tie_word_embeddings=tied)
    plain = LLM(str(model_dir), dtype="float32", quant=method, quant_lm_head=False)
    llm = LLM(str(model_dir), dtype="float32", quant=method, quant_lm_head=True)
    model, dense = llm.engine.executor.model, plain.engine.executor.model
    head = model.lm_head
    assert head.logits_kernel is not None and dense.lm_head.logits_kernel is None
    assert (head is model.model.embed_tokens) == tied
    # untied: the 16-bit rows are freed; tied: they stay for the lookups, unless the
    # head's format serves them (int8: then the lookups read its rows)
    # (QuantMethod.serves_rows declares it: int8's kernel has rows, the others' none)
    serves = METHODS[method].serves_rows
    assert serves == (method == "int8")
    assert head.lookups_from_kernel == (tied and serves)
    assert (head.weight.numel() == 0) == (not tied or serves)
    table = dense.model.embed_tokens.weight
    ids = torch.tensor([[0, 5, 9], [2, 33, 1]])
    lookups = model.model.embed_tokens(ids)
    err = float((lookups - table[ids]).norm() / table[ids].norm())
    assert lookups.shape == (2, 3, table.shape[1]) and err < (0.01 if tied else 1e-7)
    hidden = torch.randn(5, table.shape[1])
    got = model.compute_logits(hidden)
    expected = dense.compute_logits(hidden)
    assert got.shape == expected.shape
    err = float((got - expected).norm() / expected.norm())
    assert 0 < err < {"int8": 0.02, "fp8": 0.08, "int4": 0.2}[method]  # quantized, and close
    params = SamplingParams(temperature=0.0, max_tokens=6)
    out = llm.generate([[5, 9, 2, 33]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 6


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_lm_head_follows_the_method_s_default_when_unset(method, tiny_model_factory):
    # int8's head costs no quality (docs/quantization.md) and is quantized unless the
    # config says no; int4's is int8 (its own 4 bits cost +45.6%); fp8's doubles its
    # loss and stays 16-bit unless asked
    from tokenloom import LLM
    from tokenloom.plugins.quant.int8 import Int8Kernel

    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), dtype="float32", quant=method)
    kernel = llm.engine.executor.model.lm_head.logits_kernel
    assert (kernel is not None) == (method in ("int8", "int4"))
    assert isinstance(kernel, Int8Kernel) == (method in ("int8", "int4"))
    # asked: the method's own format; refused: 16-bit
    asked = LLM(str(model_dir), dtype="float32", quant=method, quant_lm_head=True)
    own = asked.engine.executor.model.lm_head.logits_kernel
    assert type(own).__name__.lower().startswith(method)
    refused = LLM(str(model_dir), dtype="float32", quant=method, quant_lm_head=False)
    assert refused.engine.executor.model.lm_head.logits_kernel is None


def test_quant_lm_head_needs_a_weight_method():
    # checked when the engine resolves its quant method (a quantized checkpoint's own
    # method counts: test_checkpoints.py), not when the config is built
    from tokenloom.config import ConfigError
    from tokenloom.engine.engine_core import resolve_quant
    from tokenloom.plugin_manager import PluginManager

    config = EngineConfig(quant_lm_head=True)
    with pytest.raises(ConfigError, match="quant_lm_head"):
        resolve_quant(config, PluginManager.default())
    assert resolve_quant(EngineConfig(quant="int8", quant_lm_head=True), None).quant == "int8"


def test_int4_builds_its_int8_head_from_the_engine_s_plugins(tiny_model_factory, monkeypatch):
    # the head's method comes from the manager that built the engine's components (a
    # plugin set without the defaults, or with a user's, is the one asked), not from a
    # fresh PluginManager.default()
    from tokenloom import LLM
    from tokenloom.plugin_manager import PluginManager

    built = []
    build = PluginManager.build

    def spy(self, kind, name, *args, **kwargs):
        component = build(self, kind, name, *args, **kwargs)
        built.append((id(self), kind, name, getattr(component, "plugins", None) is self))
        return component

    monkeypatch.setattr(PluginManager, "build", spy)
    LLM(str(tiny_model_factory("llama")), dtype="float32", quant="int4")
    quant = [(manager, name, bound) for manager, kind, name, bound in built if kind == "quant"]
    assert [name for _, name, _ in quant] == ["int4", "int8"]
    assert quant[0][0] == quant[1][0] and all(bound for _, _, bound in quant)
