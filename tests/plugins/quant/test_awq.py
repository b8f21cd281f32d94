"""AWQ (plugins/quant/awq.py): scaling and folding leave a float model's outputs
unchanged (grouped-query attention and q/k/v biases included); the searched scale
leaves no more rounded output error than plain RTN (alpha = 0), and less on inputs
with a few large channels; ``tokenloom quantize --awq`` writes a checkpoint that
loads with the in-memory AWQ + GPTQ values and generates the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.quant.awq import (
    AwqScaler,
    InputStats,
    int4_rtn,
    search_clip,
    search_scale,
    value_rows_of_o_inputs,
)
from tokenloom.plugins.quant.calibration import CausalAttention
from tokenloom.plugins.quant.gptq import Int4Grid, gptq, output_error
from tokenloom.plugins.quant.int4 import dequantize_int4
from tokenloom.protocols.components.attention import ForwardContext


def _ctx(model) -> ForwardContext:
    layers = len(model.model.layers)
    return ForwardContext(
        attn=CausalAttention(),  # type: ignore[arg-type]
        meta=None,  # type: ignore[arg-type]
        kv_caches=[(torch.empty(0), torch.empty(0))] * layers,
    )


def _hidden(model, ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor(ids)
    return model.model(tokens, torch.arange(len(ids)), _ctx(model))


@torch.no_grad()
def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model.compute_logits(_hidden(model, ids)[-1:]).argmax()))
    return ids[len(prompt) :]


def test_o_proj_inputs_read_the_value_row_of_their_kv_head():
    # 4 query heads of dim 2 on 2 value heads: heads 0, 1 read value head 0
    assert value_rows_of_o_inputs(4, 2, 2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert value_rows_of_o_inputs(2, 2, 3).tolist() == list(range(6))


def test_int4_rtn_is_the_grid_of_gptq_without_feedback():
    w = 0.05 * torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    ref = gptq(w, torch.eye(96), Int4Grid(32, static=True))  # H = I: no error moves
    assert torch.equal(int4_rtn(32)(w), ref)


def _stats(x: torch.Tensor) -> InputStats:
    x64 = x.double()
    return InputStats(x64.abs().sum(0), x64.t() @ x64, x.shape[0])


def test_searched_scale_leaves_less_error_than_rtn_on_inputs_with_large_channels():
    gen = torch.Generator().manual_seed(1)
    k = 128
    x = torch.randn(2048, k, generator=gen)
    x[:, [3, 40, 77, 100]] *= 30.0  # a few salient channels, as in LLM activations
    w = 0.05 * torch.randn(64, k, generator=gen)
    stats = _stats(x)
    s, alpha, errors = search_scale(w, stats, int4_rtn(32))
    assert errors[alpha] == min(errors.values()) and set(errors) >= {0.0, 1.0}
    rtn = int4_rtn(32)(w)
    assert errors[0.0] == pytest.approx(output_error(w, rtn, stats.h()), rel=1e-4)
    assert alpha > 0 and errors[alpha] < 0.8 * errors[0.0]
    scaled = int4_rtn(32)(w * s) / s  # the effective weight
    assert output_error(w, scaled, x.t() @ x) < 0.8 * output_error(w, rtn, x.t() @ x)
    # tied channels share one scale
    tie = torch.arange(k) % 64
    s_tied, _, _ = search_scale(w, stats, int4_rtn(32), tie)
    assert torch.equal(s_tied[:64], s_tied[64:])


def test_clip_search_keeps_each_groups_error_at_most_that_of_the_full_range():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 80, generator=gen)
    w = 0.05 * torch.randn(32, 80, generator=gen)  # the last group is short (80 = 2 * 32 + 16)
    w[::2, 5] = 1.0  # an outlier weight stretches half the rows' first group
    w[1::2, 70] = 1.0  # and the other half's last
    h = x.t() @ x
    clipped, ratios = search_clip(w, h, int4_rtn(32), 32)
    assert ratios.shape == (32, 3) and bool(((ratios >= 0.55) & (ratios <= 1.0)).all())
    assert float(ratios[::2, 0].min()) < 1.0 and float(ratios[1::2, 2].min()) < 1.0
    full, clip = w - int4_rtn(32)(w), w - int4_rtn(32)(clipped)
    for g in (slice(0, 32), slice(32, 64), slice(64, 80)):
        per_row = [torch.einsum("ni,ij,nj->n", d[:, g], h[g, g], d[:, g]) for d in (full, clip)]
        assert bool((per_row[1] <= per_row[0] * (1 + 1e-5)).all())
    assert output_error(w, int4_rtn(32)(clipped), h) < output_error(w, int4_rtn(32)(w), h)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("grid", [(0.5,), None], ids=["alpha-0.5", "searched"])
def test_scaling_and_folding_leave_the_float_model_unchanged(arch, grid, tiny_model_factory):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny_model_factory(arch), torch.float32, "cpu")  # 4 q, 2 kv heads
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 200, (40,), generator=gen).tolist() for _ in range(3)]
    with torch.no_grad():
        before = [_hidden(model, ids) for ids in sequences]
        norms = [layer.input_layernorm.weight.clone() for layer in model.model.layers]
        scaler = AwqScaler(int4_rtn(32), **({"grid": grid} if grid else {}))
        for index, layer in enumerate(model.model.layers):
            scaler(index, layer, lambda: [_hidden(model, ids) for ids in sequences])
        after = [_hidden(model, ids) for ids in sequences]
    assert len(scaler.alphas) == 4 * len(model.model.layers)
    assert all(0.0 < g <= 1.0 for g in scaler.gains.values())
    if grid:  # scales really moved weights around
        change = (model.model.layers[0].input_layernorm.weight - norms[0]).abs().max()
        assert float(change) > 1e-2 * float(norms[0].abs().max())
    for b, a in zip(before, after, strict=True):
        assert float((a - b).abs().max()) < 1e-5 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("clip", [False, True], ids=["awq", "awq-clip"])
def test_quantize_awq_writes_a_checkpoint_that_loads_as_quantized_in_memory(clip, tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.calibration import quantize_sequentially, sample_calibration_tokens

    out = tmp_path / "awq"
    args = [
        "--method",
        "int4",
        "--awq",
        "--rounding",
        "gptq",
        "--out",
        str(out),
        "--calibration-tokens",
        "256",
    ]
    args += ["--awq-clip"] if clip else []
    assert main([str(tiny), *args, "--seq-len", "64", "--group-size", "32", "--threads", "1"]) == 0
    about = json.loads((out / "quantize.json").read_text())
    assert about["method"] == "awq + gptq int4" and len(about["awq_alpha"]) == 8
    assert main([str(tiny), "--method", "fp8", "--awq", "--out", str(tmp_path / "x")]) == 2
    no_awq = ["--method", "int4", "--no-awq", "--awq-clip", "--out", str(tmp_path / "x")]
    assert main([str(tiny), *no_awq]) == 2
    assert ("awq_mean_clip_ratio" in about) == clip
    # the same calibration again (seeded): the values the checkpoint must hold
    sequences = sample_calibration_tokens(str(tiny), 256, 64, 0)
    model, _ = load_model(tiny, torch.float32, "cpu")
    scaler = AwqScaler(int4_rtn(32), clip_group=32 if clip else 0)
    quantize_sequentially(
        model, sequences, lambda: Int4Grid(32, static=True), act_order=True, prepare_layer=scaler
    )
    assert scaler.alphas == about["awq_alpha"]
    assert scaler.clips == about.get("awq_mean_clip_ratio", {})
    prompt = [5, 6, 7, 8]
    expected = _greedy(model, prompt, 8)

    llm = LLM(str(out), dtype="float32", quant="int4")
    try:
        loaded = llm.engine.executor.model.model.layers[1]
        mine = model.model.layers[1]
        for name in ("input_layernorm", "post_attention_layernorm"):  # the folded norms
            assert torch.equal(loaded.get_submodule(name).weight, mine.get_submodule(name).weight)
        for name in ("mlp.gate_up_proj", "self_attn.qkv_proj"):  # up / v rows folded
            k = loaded.get_submodule(name).kernel
            values = dequantize_int4(k.qweight, k.scales, k.zeros, 32, torch.float32)
            assert torch.equal(values, mine.get_submodule(name).weight.data)
        outs = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
        assert list(outs[0].outputs[0].token_ids) == expected
    finally:
        llm.engine.shutdown()
