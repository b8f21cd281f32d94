"""GPTQ (plugins/quant/gptq.py): on one layer with correlated inputs it leaves less
output error than round-to-nearest on the same grid, for int4 groups and fp8 rows;
its codes are the values it returns; and ``tokenloom quantize`` writes checkpoints
that the int4 (GPTQ) and fp8 (fbgemm_fp8) readers load with exactly those values."""

from __future__ import annotations

import json

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.quant.gptq import Fp8Grid, Int4Grid, gptq, output_error
from tokenloom.plugins.quant.gptq_checkpoint import pack_columns
from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int4_checkpoints import unpack_columns
from tokenloom.plugins.quant.int4_pack import unpack_int4

GRIDS = {"int4": lambda: Int4Grid(32), "fp8": Fp8Grid}


def _layer(seed: int = 0, n: int = 64, k: int = 128, tokens: int = 1024):
    """A weight and the ``X^T X`` of inputs with correlated channels and a few large
    ones (as transformer activations have)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5
    x = torch.randn(tokens, k, generator=gen) @ mix + 0.1 * torch.randn(tokens, k, generator=gen)
    x[:, :4] *= 8.0
    w = 0.05 * torch.randn(n, k, generator=gen)
    return w, x.t() @ x


@pytest.mark.parametrize("method", list(GRIDS))
def test_gptq_leaves_less_output_error_than_round_to_nearest_on_the_same_grid(method):
    w, h = _layer()
    q = gptq(w, h, GRIDS[method]())
    # with H = I no error moves to other columns: GPTQ reduces to RTN on the same grid
    rtn = gptq(w, torch.eye(h.shape[0]), GRIDS[method]())
    assert output_error(w, q, h) < 0.6 * output_error(w, rtn, h)
    assert output_error(w, rtn, torch.eye(h.shape[0])) < output_error(w, q, torch.eye(h.shape[0]))


def test_act_order_visits_columns_out_of_order_and_keeps_groups_in_place():
    w, h = _layer(seed=4)
    grid = Int4Grid(32, static=True)
    q = gptq(w, h, grid, act_order=True)
    rtn = gptq(w, torch.eye(h.shape[0]), Int4Grid(32, static=True))
    assert output_error(w, q, h) < 0.6 * output_error(w, rtn, h)
    qweight, scales, zeros = grid.packed()  # groups are k // 32: no permutation stored
    assert torch.equal(dequantize_int4(qweight, scales, zeros.half(), 32, torch.float32), q)
    with pytest.raises(ValueError, match="static"):
        gptq(w, h, Int4Grid(32), act_order=True)


def test_int4_grid_without_feedback_is_the_rtn_of_load_time_quantization():
    w, _ = _layer(seed=1)
    w = w.half().float()  # RTN at load takes 16-bit weights
    w[:, 0:32] = w[:, 0:32].abs()  # a group with no negative weight: zero point kept at 1
    grid = Int4Grid(32)
    q = gptq(w, torch.eye(w.shape[1]), grid)
    qweight, scales, zeros = grid.packed()
    assert int(zeros.min()) >= 1  # the classic GPTQ format stores z - 1 in four bits
    assert torch.equal(dequantize_int4(qweight, scales, zeros.half(), 32, torch.float32), q)
    ref = dequantize_int4(*quantize_int4(w.half(), 32), 32, torch.float32)
    assert torch.equal(q[:, 32:], ref[:, 32:])
    assert bool(((q[:, :32] - w[:, :32]).abs() <= scales[0, :, None].float() / 2 + 1e-6).all())


def test_fp8_grid_codes_dequantize_to_the_returned_weight():
    w, h = _layer(seed=2)
    grid = Fp8Grid()
    q = gptq(w, h, grid)
    assert grid.codes is not None and grid.scales is not None
    assert torch.equal(grid.codes.float() * grid.scales, q)
    assert bool((grid.codes.float().abs() <= 448).all())


def test_zero_points_pack_along_the_outputs_as_the_reader_unpacks_them():
    values = torch.randint(0, 16, (3, 24), dtype=torch.int32)
    assert torch.equal(unpack_columns(pack_columns(values), tuple(range(8))), values)


def test_dead_input_channels_get_zero_weight():
    w, h = _layer(seed=3)
    h[5, :] = 0
    h[:, 5] = 0
    q = gptq(w, h, Fp8Grid())
    assert bool((q[:, 5] == 0).all()) and bool(torch.isfinite(q).all())


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantize_writes_a_checkpoint_the_reader_loads_with_the_gptq_values(method, tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.calibration import quantize_sequentially, sample_calibration_tokens

    out = tmp_path / method
    args = [
        "--method",
        method,
        "--rounding",
        "gptq",
        "--tune-scales",
        "0",
        "--out",
        str(out),
        "--calibration-tokens",
        "256",
    ]
    args += ["--no-awq"] if method == "int4" else []  # GPTQ alone (test_awq covers --awq)
    assert main([str(tiny), *args, "--seq-len", "64", "--group-size", "32", "--threads", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == (
        "gptq" if method == "int4" else "fbgemm_fp8"
    )
    # the same calibration again (seeded) gives the values the checkpoint must hold
    sequences = sample_calibration_tokens(str(tiny), 256, 64, 0)
    model, _ = load_model(tiny, torch.float32, "cpu")
    grid = (lambda: Int4Grid(32, static=True)) if method == "int4" else Fp8Grid
    quantize_sequentially(model, sequences, grid, act_order=method == "int4")  # GPTQ's defaults
    expected = model.model.layers[1].mlp.gate_up_proj.weight.data

    llm = LLM(str(out), dtype="float32", quant=method)
    try:
        layer = llm.engine.executor.model.model.layers[1].mlp.gate_up_proj
        kernel = layer.kernel
        if method == "int4":
            loaded = dequantize_int4(kernel.qweight, kernel.scales, kernel.zeros, 32, torch.float32)
            assert int(unpack_int4(kernel.qweight).max()) <= 15
        else:
            loaded = kernel.weight.float() * kernel.scales
            assert kernel.scales.shape == (layer.out_features, 1)  # one scale per row
        assert layer.weight.numel() == 0  # the dense weight is freed
        assert torch.equal(loaded, expected)
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(outs[0].outputs[0].token_ids) == 8
    finally:
        llm.engine.shutdown()


def test_the_calibration_cache_is_written_then_read_and_must_match(tiny, tmp_path, monkeypatch):
    from tokenloom.plugins.quant import calibration

    cache = tmp_path / "sample.json"
    sampled = calibration.sample_calibration_tokens(str(tiny), 192, 64, 3, cache)
    assert len(sampled) == 3 and all(len(s) == 64 for s in sampled)
    assert cache.exists()

    def no_sampling(*_):  # type: ignore[no-untyped-def]
        raise AssertionError("sampled again despite the cache")

    monkeypatch.setattr(calibration, "_sample", no_sampling)
    assert calibration.sample_calibration_tokens(str(tiny), 192, 64, 3, cache) == sampled
    # fewer sequences: the first ones (sequence i is drawn with seed + i)
    assert calibration.sample_calibration_tokens(str(tiny), 128, 64, 3, cache) == sampled[:2]
    for wrong in ((192, 64, 4), (192, 32, 3), (256, 64, 3), (128, 64, 2), (128, 64, 19)):
        with pytest.raises(ValueError, match="calibration cache"):  # seed, length, too few
            calibration.sample_calibration_tokens(str(tiny), *wrong, cache)


def test_a_calibration_cache_serves_seeds_a_prompt_period_above_its_own(tiny, tmp_path):
    from tokenloom.plugins.quant import calibration

    period, length = calibration.PERIOD, 64
    cache = tmp_path / "sample.json"
    whole = calibration.sample_calibration_tokens(
        str(tiny), (period + 3) * length, length, 3, cache
    )
    fresh = calibration.sample_calibration_tokens(str(tiny), 3 * length, length, 3 + period)
    assert fresh == whole[period:]  # what sampling at that seed draws, so the cache serves it
    assert (
        calibration.sample_calibration_tokens(str(tiny), 3 * length, length, 3 + period, cache)
        == fresh
    )
    assert fresh != whole[:3]


def test_the_sequential_gptq_records_no_gradients(tiny):
    # on a GPU the model's fused norm, SiLU and rope run only where no gradient is
    # recorded (layers.fused): GPTQ's and AWQ's layer passes must run under no_grad
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.calibration import quantize_sequentially

    model, _ = load_model(tiny, torch.float32, "cpu")
    seen: list[bool] = []
    layer = model.model.layers[0].self_attn.o_proj
    layer.register_forward_pre_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    sequences = [[5, 6, 7, 8, 9, 10, 11, 12]] * 2
    quantize_sequentially(model, sequences, lambda: Int4Grid(32))
    assert seen and not any(seen)
