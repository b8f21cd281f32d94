"""Pre-quantized checkpoints load directly: fp8 ones (per-tensor scales, as vLLM reads
them; per channel; block-wise) and 4-bit AWQ, GPTQ (act-order too) and compressed-tensors
ones. Each is written from a tiny random model (``checkpoint_writers.py``); the loaded
kernels must hold exactly the stored values, and the engine must generate from them the
same tokens as from a 16-bit checkpoint of the same values. Also: a checkpoint's own
format taken when ``quant`` is left at none, and the order in which methods are asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_writers import (
    FP8_CONFIG,
    PARAMS,
    PROMPTS,
    TOKEN_FP8,
    ct_fp8_config,
    ct_fp8_convert,
    ct_int8_config,
    ct_int8_convert,
    dense_twin,
    fp8_convert,
    greedy_tokens,
    int4_config,
    int4_convert,
    load_on_rank,
    pack_columns,
    rewrite,
)

from tokenloom import LLM
from tokenloom.plugins.quant.int4 import dequantize_int4
from tokenloom.plugins.quant.int4_checkpoints import AWQ_ORDER, unpack_columns


def test_column_packing_round_trips_in_awq_order():
    q = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    assert torch.equal(unpack_columns(pack_columns(q, AWQ_ORDER), AWQ_ORDER), q)
    word = int(pack_columns(q, AWQ_ORDER)[0, 0])
    assert (word >> 4) & 0xF == int(q[0, 2])  # AWQ's nibble 1 is column 2


@pytest.fixture
def allocations(monkeypatch) -> list:
    """The ``Linear`` layers whose deferred dense weight the loader allocated (the
    engine streams its weight methods: a pre-quantized layer never needs one)."""
    from tokenloom.plugins.models.layers import Linear

    allocated: list = []
    real = Linear.materialize_weight

    def spy(self):
        before = self.weight.shape
        real(self)
        if self.weight.shape != before:
            allocated.append(self)

    monkeypatch.setattr(Linear, "materialize_weight", spy)
    return allocated


def test_fp8_checkpoint_loads_its_weights_and_per_tensor_scales(tiny, tmp_path, allocations):
    stored: dict[str, torch.Tensor] = {}
    fp8_dir = rewrite(tiny, tmp_path / "fp8", fp8_convert(stored), FP8_CONFIG)
    llm = LLM(str(fp8_dir), dtype="float32", quant="fp8")
    try:
        attn = llm.engine.executor.model.model.layers[0].self_attn
        kernel = attn.qkv_proj.kernel
        # each part keeps its own scale; on the engine's device (CUDA where present)
        loaded = (kernel.weight.float() * kernel.scales).cpu()
        prefix = "model.layers.0.self_attn"
        expected = torch.cat([stored[f"{prefix}.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(loaded, expected)
        assert attn.qkv_proj.weight.numel() == 0
        assert allocations == []  # no layer held a dense weight, even for a moment
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("method", "skipped"),
    [
        ("awq", []),
        ("gptq", []),
        ("awq", ["down_proj"]),
        ("ct", []),
        ("ct-asym", ["down_proj"]),
        ("gptq-act", []),
        ("ct-act", []),
    ],
)
def test_int4_checkpoint_generates_as_its_dense_twin(
    method, skipped, tiny, tmp_path, allocations, monkeypatch
):
    group = 32  # the tiny model's K (64, 128) holds several groups
    dequantized: dict[str, torch.Tensor] = {}
    convert = int4_convert(method, group, skipped, dequantized)
    quantized = rewrite(tiny, tmp_path / method, convert, int4_config(method, group, skipped))
    twin = dense_twin(tiny, tmp_path / "dense", dequantized)
    assert greedy_tokens(quantized, "int4") == greedy_tokens(twin, "none")
    if method.endswith("-act"):  # the groups gathered, the inputs gathered at each call
        from tokenloom.plugins.quant.common import PermutedInputKernel

        gathered: set[int] = set()  # the kernels whose apply gathered its input
        in_order: set[int] = set()  # those handed rows already in their input order
        apply, permuted = PermutedInputKernel.apply, PermutedInputKernel.apply_permuted

        def spy_apply(self, x, bias):
            gathered.add(id(self))
            return apply(self, x, bias)

        def spy_permuted(self, x, bias):
            in_order.add(id(self))
            return permuted(self, x, bias)

        monkeypatch.setattr(PermutedInputKernel, "apply", spy_apply)
        monkeypatch.setattr(PermutedInputKernel, "apply_permuted", spy_permuted)
        llm = LLM(str(quantized), dtype="float32", quant="int4")
        try:
            layer = llm.engine.executor.model.model.layers[0]
            attn, mlp = layer.self_attn, layer.mlp
            llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
            # the norms store their columns in qkv's and gate/up's input order, SiLU in
            # down's; only o (after the attention) gathers its own input
            folded = {id(attn.qkv_proj.kernel), id(mlp.gate_up_proj.kernel)}
            folded.add(id(mlp.down_proj.kernel))
            assert folded <= in_order and not folded & gathered
            assert id(attn.o_proj.kernel) in gathered
            down = mlp.down_proj
            assert isinstance(down.kernel, PermutedInputKernel)
            x = torch.randn(3, down.in_features, device=down.input_perm.device)
            want = x.cpu() @ dequantized["model.layers.0.mlp.down_proj"].t()
            torch.testing.assert_close(down.kernel.apply(x, None).cpu(), want)
            order = down.input_order
            assert order is not None
            assert not torch.equal(order, torch.arange(len(order), device=order.device))
            torch.testing.assert_close(down.kernel.apply_permuted(x[:, order], None).cpu(), want)
        finally:
            llm.engine.shutdown()
    if skipped:
        allocations.clear()
        llm = LLM(str(quantized), dtype="float32", quant="int4")
        try:
            # the layers the checkpoint left 16-bit, and only they, got dense weights
            model = llm.engine.executor.model
            assert {id(m) for m in allocations} == {
                id(layer.mlp.down_proj) for layer in model.model.layers
            }
            mlp = llm.engine.executor.model.model.layers[0].mlp
            assert mlp.down_proj.kernel is None and mlp.down_proj.weight.numel() > 0
            assert mlp.gate_up_proj.kernel is not None
        finally:
            llm.engine.shutdown()


def test_act_order_gptq_is_refused_on_a_shard_of_the_inputs(tiny, tmp_path):
    # a row-parallel rank's inputs hold a part of every act-order group
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.quant.int4 import Int4Quant

    convert = int4_convert("gptq-act", 32, [], {})
    path = rewrite(tiny, tmp_path / "gptq-act", convert, int4_config("gptq-act", 32, []))
    quant = Int4Quant(EngineConfig(quant="int4"))
    with pytest.raises(ValueError, match="act-order g_idx on a shard of the inputs"):
        load_on_rank(path, quant, 0)


def test_block_wise_fp8_checkpoint_loads_requantized_per_channel(tiny, tmp_path):
    stored: dict[str, torch.Tensor] = {}

    def convert(prefix, w):
        n, k = w.shape
        blocks = w.float().view(n // 32, 32, k // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [N / 32, K / 32]
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        q = (w.float() / full).to(torch.float8_e4m3fn)
        stored[prefix] = q.float() * full
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale}

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    llm = LLM(str(rewrite(tiny, tmp_path / "fp8b", convert, qc)), dtype="float32", quant="fp8")
    try:
        mlp = llm.engine.executor.model.model.layers[1].mlp
        kernel = mlp.gate_up_proj.kernel
        loaded = (kernel.weight.float() * kernel.scales).cpu()  # CUDA where present
        prefix = "model.layers.1.mlp"
        expected = torch.cat([stored[f"{prefix}.gate_proj"], stored[f"{prefix}.up_proj"]])
        row_max = expected.abs().amax(dim=1, keepdim=True)
        assert bool(((loaded - expected).abs() <= row_max * 2**-4).all())
        assert not hasattr(mlp.gate_up_proj, "block_scales")  # freed after requantizing
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["gptq", "awq", "ct-asym"])
def test_int4_checkpoint_shards_over_two_ranks(method, tiny, tmp_path):
    # each rank's kernels hold its slice of the checkpoint: row-parallel layers (o, down)
    # a range of K, which GPTQ's g_idx check must read from the shard's first row
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.quant.int4 import Int4Quant

    dequantized: dict[str, torch.Tensor] = {}
    convert = int4_convert(method, 32, [], dequantized)
    path = rewrite(tiny, tmp_path / method, convert, int4_config(method, 32, []))
    full = dequantized["model.layers.0.mlp.down_proj"]  # [N, K]
    for rank in (0, 1):
        quant = Int4Quant(EngineConfig(quant="int4"))
        model = load_on_rank(path, quant, rank)
        quant.quantize_model(model)
        down = model.model.layers[0].mlp.down_proj
        lo, hi = down.in_range
        assert (lo, hi) == (rank * full.shape[1] // 2, (rank + 1) * full.shape[1] // 2)
        k = down.kernel
        got = dequantize_int4(k.qweight, k.scales, k.zeros, k.group, torch.float32)
        assert torch.equal(got, full[:, lo:hi])


@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq", "ct", "ct-fp8", "ct-int8"])
def test_a_quantized_checkpoint_loads_with_its_own_method_when_quant_is_left_none(
    fmt, tiny, tmp_path
):
    """``quant = "none"`` (the default) on a checkpoint whose config.json names its
    format serves it with the method that loads that format, token for token as when
    the method is named; ``tokenloom plan`` counts it the same way."""
    from tokenloom.config import load_config
    from tokenloom.entrypoints.plan import make_plan

    if fmt == "fp8":
        convert, qc, method = fp8_convert({}), FP8_CONFIG, "fp8"
    elif fmt == "ct-fp8":
        convert, qc, method = ct_fp8_convert("channel", {}), ct_fp8_config("channel"), "fp8"
    elif fmt == "ct-int8":
        convert, qc, method = ct_int8_convert(True, {}), ct_int8_config(True), "int8"
    else:
        convert, qc, method = int4_convert(fmt, 32, [], {}), int4_config(fmt, 32, []), "int4"
    quantized = rewrite(tiny, tmp_path / fmt, convert, qc)
    llm = LLM(str(quantized), dtype="float32")
    try:
        assert llm.engine.config.quant == method
        assert llm.engine.executor.model.model.layers[0].mlp.down_proj.kernel is not None
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        auto = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert auto == greedy_tokens(quantized, method)
    plan = make_plan(load_config(model=str(quantized), dtype="float32"), gpu_memory_gb=16)
    assert plan.quant == method


def test_a_checkpoint_in_a_format_no_method_loads_is_refused_by_name(tiny, tmp_path):
    from tokenloom.config import ConfigError

    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    quantized = rewrite(tiny, tmp_path / "bnb", lambda p, w: {f"{p}.weight": w}, qc)
    with pytest.raises(ConfigError, match="'bitsandbytes'.*no registered quant method.*awq"):
        LLM(str(quantized), dtype="float32")


def test_quant_lm_head_takes_the_checkpoint_s_own_method(tiny, tmp_path):
    """``--quant-lm-head`` needs a weight method: a quantized checkpoint's own, with
    ``quant`` left at none; a 16-bit model without ``--quant`` is refused."""
    from tokenloom.config import ConfigError

    with pytest.raises(ConfigError, match="quant_lm_head: needs a weight quantization method"):
        LLM(str(tiny), dtype="float32", quant_lm_head=True)
    qc = ct_fp8_config("channel")
    path = rewrite(tiny, tmp_path / "ct-fp8", ct_fp8_convert("channel", {}), qc)
    llm = LLM(str(path), dtype="float32", quant_lm_head=True)
    try:
        assert llm.engine.config.quant == "fp8"
        assert llm.engine.executor.model.lm_head.logits_kernel is not None
    finally:
        llm.engine.shutdown()


def test_checkpoint_quant_asks_every_reader_and_plain_format_lists():
    """A reader that cannot serve a compressed-tensors scheme passes the question on (a
    third-party method that lists the format then gets it); a factory that only lists
    ``checkpoint_formats`` (no ``reads_checkpoint``) is still chosen by them."""
    from types import SimpleNamespace

    from tokenloom.plugins.quant.fp8 import Fp8Quant
    from tokenloom.plugins.quant.int4 import Int4Quant
    from tokenloom.plugins.quant.int8 import Int8Quant
    from tokenloom.protocols.components.quant import checkpoint_quant

    def exl2(config):  # a factory function, not a QuantMethod subclass
        raise AssertionError("not built here")

    def w4a8(config):
        raise AssertionError("not built here")

    exl2.checkpoint_formats = ("exl2",)
    w4a8.checkpoint_formats = ("compressed-tensors",)

    def plugins(*factories):
        comps = [
            SimpleNamespace(kind="quant", name=n, spec=SimpleNamespace(factory=f))
            for n, f in factories
        ]
        return SimpleNamespace(components=lambda: sorted(comps, key=lambda c: c.name))

    builtin = [("fp8", Fp8Quant), ("int4", Int4Quant), ("int8", Int8Quant)]
    qc = int4_config("ct", 32, [])
    qc["config_groups"]["group_0"]["input_activations"] = TOKEN_FP8 | {"type": "int"}
    with pytest.raises(ValueError, match="no method here serves it"):
        checkpoint_quant({"quantization_config": qc}, plugins(*builtin))
    assert (
        checkpoint_quant({"quantization_config": qc}, plugins(*builtin, ("w4a8", w4a8))) == "w4a8"
    )
    exl2_config = {"quantization_config": {"quant_method": "exl2"}}
    assert checkpoint_quant(exl2_config, plugins(*builtin, ("exl2", exl2))) == "exl2"
    w4a16 = {"quantization_config": int4_config("ct", 32, [])}
    assert checkpoint_quant(w4a16, plugins(*builtin, ("w4a8", w4a8))) == "int4"  # by name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["ct", "ct-asym", "ct-act", "gptq-act"])
def test_int4_checkpoints_on_the_gpu_kernels(method, tiny_model_factory, tmp_path):
    """bf16 on the GPU: the checkpoint's words feed the Triton kernels (compressed-
    tensors' ``[N, K / 8]`` words as the row-major storage the one-row GEMV streams),
    every projection of a layer gives ``x W^T`` of its dequantized weight at 1 and 16
    rows, and the model generates in its CUDA graphs."""
    shape = {"hidden_size": 1024, "intermediate_size": 2048, "num_heads": 8, "num_kv_heads": 2}
    model = Path(tiny_model_factory("llama", **shape))
    dequantized: dict[str, torch.Tensor] = {}
    convert = int4_convert(method, 128, [], dequantized)
    path = rewrite(model, tmp_path / method, convert, int4_config(method, 128, []))
    llm = LLM(str(path), dtype="bfloat16", quant="int4")
    try:
        layer = llm.engine.executor.model.model.layers[0]
        parts = {
            layer.self_attn.qkv_proj: ("self_attn", ("q_proj", "k_proj", "v_proj")),
            layer.self_attn.o_proj: ("self_attn", ("o_proj",)),
            layer.mlp.gate_up_proj: ("mlp", ("gate_proj", "up_proj")),
            layer.mlp.down_proj: ("mlp", ("down_proj",)),
        }
        for linear, (block, names) in parts.items():
            w = torch.cat([dequantized[f"model.layers.0.{block}.{n}"] for n in names]).cuda()
            kernel = getattr(linear.kernel, "inner", linear.kernel)
            assert kernel.configs is not None  # the Triton kernels, not the reference
            if method.startswith("ct"):
                assert kernel.qweight.t().is_contiguous()  # [N, K / 8] words, row-major
            for m in (1, 16):
                x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
                expected = x.double() @ w.double().t()
                y = linear.kernel.apply(x, None).double()
                assert float((y - expected).norm() / expected.norm()) < 1e-2, (names, m)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()
