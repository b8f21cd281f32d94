"""compressed-tensors checkpoints (llm-compressor's format) load into fp8, int4 and int8:
every scheme read gives its dense twin's values and tokens, shards over two ranks, and
every scheme or layout not read is refused by name. The int4 schemes' twins are in
``test_checkpoints.py`` with the other 4-bit formats."""

from __future__ import annotations

import pytest
import torch
from checkpoint_writers import (
    PARAMS,
    PROMPTS,
    TOKEN_FP8,
    ct_fp8_config,
    ct_fp8_convert,
    ct_int8_config,
    ct_int8_convert,
    dense_twin,
    greedy_tokens,
    int4_config,
    load_on_rank,
    rewrite,
)

from tokenloom import LLM


@pytest.mark.parametrize(
    ("strategy", "activations"),
    [("channel", TOKEN_FP8), ("tensor", TOKEN_FP8 | {"strategy": "tensor", "dynamic": False}),
     ("block", None)],
)  # fmt: skip
def test_compressed_tensors_fp8_loads_each_strategy(strategy, activations, tiny, tmp_path):
    """Per channel: the very values of fp8 at load (the same tokens); per tensor: each
    part keeps its scale; per block: quantized again per channel. Static activation
    scales and a kv_cache_scheme's scales are read past; the LM head stays 16-bit."""
    stored: dict[str, torch.Tensor] = {}
    convert = ct_fp8_convert(strategy, stored)
    static = activations is not None and not activations["dynamic"]

    def with_extras(prefix, w):
        out = convert(prefix, w)
        if static:
            out[f"{prefix}.input_scale"] = torch.ones(1)
        if prefix.endswith("k_proj"):  # a kv_cache_scheme's static scales
            attn = prefix.removesuffix(".k_proj")
            out |= {f"{attn}.k_scale": torch.ones(()), f"{attn}.v_scale": torch.ones(())}
        return out

    kv = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    qc = ct_fp8_config(strategy, activations, kv_cache_scheme=kv)
    path = rewrite(tiny, tmp_path / f"ct-{strategy}", with_extras, qc)
    llm = LLM(str(path), dtype="float32")  # quant left at none: the checkpoint says fp8
    try:
        assert llm.engine.config.quant == "fp8"
        mlp = llm.engine.executor.model.model.layers[1].mlp
        kernel = mlp.gate_up_proj.kernel
        loaded = (kernel.weight.float() * kernel.scales).cpu()
        prefix = "model.layers.1.mlp"
        expected = torch.cat([stored[f"{prefix}.gate_proj"], stored[f"{prefix}.up_proj"]])
        if strategy == "block":
            row_max = expected.abs().amax(dim=1, keepdim=True)
            assert bool(((loaded - expected).abs() <= row_max * 2**-4).all())
        else:
            assert torch.equal(loaded, expected)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert all(len(t) == 12 for t in tokens)
    if strategy == "channel":
        assert tokens == greedy_tokens(tiny, "fp8")


@pytest.mark.parametrize("packed", [True, False])
def test_compressed_tensors_int8_generates_as_its_dense_twin(packed, tiny, tmp_path):
    dequantized: dict[str, torch.Tensor] = {}
    qc = ct_int8_config(packed, activations=TOKEN_FP8 | {"type": "int"})  # W8A8: served W8A16
    path = rewrite(tiny, tmp_path / "ct-int8", ct_int8_convert(packed, dequantized), qc)
    twin = dense_twin(tiny, tmp_path / "dense", dequantized)
    # the LM head: 16-bit in both (int8 quantizes its head by default)
    llm = LLM(str(path), dtype="float32", quant="int8", quant_lm_head=False)
    try:
        kernel = llm.engine.executor.model.model.layers[0].self_attn.o_proj.kernel
        w = (kernel.qweight.t().float() * kernel.scales.t()).cpu()
        assert torch.equal(w, dequantized["model.layers.0.self_attn.o_proj"])
        assert int(kernel.qweight.min()) == -128
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    twin_llm = LLM(str(twin), dtype="float32")
    try:
        outs = twin_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert tokens == [list(o.outputs[0].token_ids) for o in outs]
    finally:
        twin_llm.engine.shutdown()


def test_compressed_tensors_schemes_no_method_serves_are_refused_by_name(tiny, tmp_path):
    from tokenloom.config import ConfigError

    def keep_dense(p, w):
        return {f"{p}.weight": w}

    w4a8 = int4_config("ct", 32, [])
    w4a8["config_groups"]["group_0"]["input_activations"] = TOKEN_FP8 | {"type": "int"}
    mixed = int4_config("ct", 32, [])
    mixed["config_groups"]["group_1"] = ct_fp8_config("channel")["config_groups"]["group_0"]
    cases = [
        (w4a8, r"int 4-bit weights per group of 32, int 8-bit activations.*no method"),
        (mixed, "2 quantization schemes"),
    ]
    for i, (qc, message) in enumerate(cases):
        path = rewrite(tiny, tmp_path / f"refused{i}", keep_dense, qc)
        with pytest.raises(ConfigError, match=message):
            LLM(str(path), dtype="float32")
    # a method named for another method's scheme says which one serves it
    path = rewrite(tiny, tmp_path / "int4", keep_dense, int4_config("ct", 32, []))
    with pytest.raises(Exception, match=r"--quant fp8: .*pack-quantized.*\(--quant int4\)"):
        LLM(str(path), dtype="float32", quant="fp8")


def test_compressed_tensors_int8_shards_over_two_ranks(tiny, tmp_path):
    # row-parallel layers (o, down) read a range of K's words; every rank reads whole
    # per-row scales
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.quant.int8 import Int8Quant, dequantize_int8

    dequantized: dict[str, torch.Tensor] = {}
    path = rewrite(tiny, tmp_path / "ct8", ct_int8_convert(True, dequantized), ct_int8_config(True))
    for name in ("mlp.down_proj", "mlp.gate_up_proj"):
        for rank in (0, 1):
            quant = Int8Quant(EngineConfig(quant="int8"))
            model = load_on_rank(path, quant, rank)
            quant.quantize_model(model)
            layer = model.model.layers[0].get_submodule(name)
            got = dequantize_int8(layer.kernel.qweight, layer.kernel.scales, torch.float32)
            if name == "mlp.down_proj":
                lo, hi = layer.in_range
                assert (
                    hi - lo == got.shape[1] < dequantized["model.layers.0.mlp.down_proj"].shape[1]
                )
                assert torch.equal(got, dequantized["model.layers.0.mlp.down_proj"][:, lo:hi])
            else:
                full = [dequantized[f"model.layers.0.mlp.{p}_proj"] for p in ("gate", "up")]
                half = full[0].shape[0] // 2
                rows = [w[rank * half : (rank + 1) * half] for w in full]
                assert torch.equal(got, torch.cat(rows))


@pytest.mark.parametrize("actorder", ["dynamic", True, "Group"])
def test_compressed_tensors_act_order_aliases_are_read_as_groups(actorder):
    from tokenloom.plugins.quant.compressed_tensors import Scheme

    qc = int4_config("ct", 32, [])
    qc["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert Scheme.from_config(qc).act_order  # a weight_g_idx a layer part
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "weight"  # stores no g_idx
    assert not Scheme.from_config(qc).act_order


def test_compressed_tensors_scheme_defaults_follow_the_format():
    """A missing strategy is inferred from the group size, a missing ``dynamic`` means
    static, and a block size may be written "NxM"."""
    from tokenloom.plugins.quant.compressed_tensors import Scheme, static_inputs

    qc = int4_config("ct", 32, [])
    del qc["config_groups"]["group_0"]["weights"]["strategy"]
    assert Scheme.from_config(qc).strategy == "group"
    fp8 = ct_fp8_config("block", {"type": "float", "num_bits": 8, "strategy": "tensor"})
    fp8["config_groups"]["group_0"]["weights"]["block_structure"] = "32x32"
    scheme = Scheme.from_config(fp8)
    assert (scheme.block, scheme.method, static_inputs(scheme)) == (
        (32, 32),
        "fp8",
        ("input_scale",),
    )


def test_compressed_tensors_int8_w8a8_with_static_activations_loads(tiny, tmp_path):
    dequantized: dict[str, torch.Tensor] = {}
    convert = ct_int8_convert(False, dequantized)

    def with_inputs(prefix, w):  # static, asymmetric activations: a scale and a zero point
        return convert(prefix, w) | {
            f"{prefix}.input_scale": torch.ones(1),
            f"{prefix}.input_zero_point": torch.zeros(1, dtype=torch.int8),
        }

    acts = {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    qc = ct_int8_config(False, acts | {"symmetric": False})
    path = rewrite(tiny, tmp_path / "w8a8", with_inputs, qc)
    twin = dense_twin(tiny, tmp_path / "dense", dequantized)
    assert greedy_tokens(path, "none") == greedy_tokens(twin, "none")  # the head: 16-bit in both


def test_compressed_tensors_refusals_by_name(tiny, tmp_path):
    """A quantized LM head (ignore leaves it out), part of a merged layer ignored,
    sparsity, online transforms and a checkpoint not stored compressed: each refused
    with its reason, before any tensor is read."""
    from tokenloom.config import ConfigError

    def keep_dense(p, w):
        return {f"{p}.weight": w}

    head = ct_fp8_config("channel", ignore=[])
    part = ct_fp8_config("channel", ignore=["lm_head", "re:.*q_proj$"])
    sparse = ct_fp8_config("channel", sparsity_config={"format": "sparse-24-bitmask"})
    transform = ct_fp8_config("channel", transform_config={"config_groups": {"u": {}}})
    frozen = ct_fp8_config("channel", quantization_status="frozen")
    cases = [
        (head, "quantizes lm_head"),
        (part, "leaves part of"),
        (sparse, "sparse weights"),
        (transform, "online transforms"),
        (frozen, "quantization_status 'frozen'"),
    ]
    for i, (qc, message) in enumerate(cases):
        path = rewrite(tiny, tmp_path / f"r{i}", keep_dense, qc)
        with pytest.raises((ConfigError, ValueError), match=message):
            LLM(str(path), dtype="float32")
