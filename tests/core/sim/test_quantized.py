"""The simulator's fp8 settings (``tokenloom.sim.quantized``): what they change in the
cost model, the planner's pool, and the H200 throughput they reproduce without being
fitted to it."""

from __future__ import annotations

import json

import pytest

from tokenloom.entrypoints.cli import main as tokenloom
from tokenloom.sim import quantized
from tokenloom.sim.cost_model import CostModel, graph_sizes


def test_fp8_changes_bytes_rates_and_efficiencies_only():
    bf16 = CostModel.shipped("llama-3-8b-calibrated")
    assert quantized.apply(bf16) is bf16
    fp8 = quantized.apply(bf16, "fp8", "fp8")
    linear_params = bf16.shape.flops_per_token / 2
    assert fp8.shape.weight_bytes == pytest.approx(bf16.shape.weight_bytes - linear_params)
    assert fp8.shape.head_flops == bf16.shape.head_flops  # the head stays 16-bit
    assert fp8.shape.kv_bytes_per_token == bf16.shape.kv_bytes_per_token / 2
    assert fp8.shape.flops_per_token == pytest.approx(
        bf16.shape.flops_per_token / quantized.FP8_GEMM_SPEEDUP
    )
    c, c16 = fp8.coefficients, bf16.coefficients
    # an fp8 cache's default blocks of 64 tokens: the fp8-MMA decode's gain there
    gain = quantized.FP8_PAGE_GAIN[64]
    assert c["kv"] == pytest.approx(c16["kv"] * quantized.FP8_KV_FACTOR * gain)
    assert 0.85 < gain < 0.95
    at16 = quantized.apply(bf16, "fp8", "fp8", block_size=16).coefficients
    assert at16["kv"] == pytest.approx(c16["kv"] * quantized.FP8_KV_FACTOR)
    assert c["gemm"] == pytest.approx(c16["gemm"] * quantized.FP8_GEMM_FACTOR)
    assert c["const"] == c16["const"] and c["attn"] == c16["attn"]
    assert "fp8 weights, fp8 KV cache" in fp8.source
    only_kv = quantized.apply(bf16, "none", "fp8")
    assert only_kv.shape.weight_bytes == bf16.shape.weight_bytes
    assert only_kv.coefficients["gemm"] == c16["gemm"]


@pytest.mark.parametrize(
    ("quant", "kv", "block_size"),
    [("int4", "auto", 0), ("int8", "auto", 0), ("none", "int8", 0), ("fp8", "fp8", 32)],
)
def test_unmeasured_settings_are_refused(quant, kv, block_size):
    with pytest.raises(ValueError, match="the simulator models"):
        quantized.apply(CostModel.shipped("llama-3-8b-calibrated"), quant, kv, block_size)


def test_the_pool_is_the_planners():
    # the engine's H200 start-up log: 114,429 blocks (docs/quantization.md)
    blocks = quantized.default_blocks("llama-3-8b", "fp8", "fp8", 512, 16)
    assert abs(blocks / 114_429 - 1) < 0.002


def test_graph_sizes_follow_max_graph_batch():
    assert graph_sizes(640)[-1] == 512
    assert graph_sizes(640, 640)[-1] == 640 and 576 in graph_sizes(640, 640)


def _simulated(tmp_path, name: str, seqs: int = 640, block_size: int = 16) -> float:
    """Issue 12's workload in the lab: output tokens/s (blocks of 16 tokens, as the
    engine's measurements below had them, unless given)."""
    out = tmp_path / name
    code = tokenloom([
        "sim", "--num-requests", "600", "--request-rate", "inf", "--prompt-len", "1000",
        "--output-len", "1000", "--length-dist", "fixed", "--quant", "fp8",
        "--kv-cache-dtype", "fp8", "--max-num-seqs", str(seqs), "--max-graph-batch", str(seqs),
        "--block-size", str(block_size), "--no-plots", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    run = json.loads((out / "sim.json").read_text())["runs"][0]
    assert run["completed"] == 600
    return run["output_token_throughput"]


# the decode attention's kv factor as each kernel stood when the workload was measured
KERNELS = {
    "today": quantized.FP8_KV_FACTOR,
    "tiles": quantized.FP8_KV_FACTOR / quantized.FP8_FOLD_GAIN,  # session 37, no fold
    "mma": quantized.FP8_KV_FACTOR_F16 * quantized.FP8_MMA_GAIN,  # session 32
    "f16": quantized.FP8_KV_FACTOR_F16,
}


@pytest.mark.parametrize(
    ("kernel", "seqs", "measured"),
    [
        ("today", 640, 14_089),  # session 38, one H200, three calls (docs/quantization.md)
        ("today", 640, 14_093),
        ("today", 640, 14_117),
        ("tiles", 640, 13_627),  # the same machine, decode_fp8_fold=0, two calls
        ("tiles", 640, 13_658),
        ("mma", 640, 13_265),  # session 32, one H200, two calls
        ("mma", 640, 13_463),
        ("f16", 512, 12_023),  # session 9: the f16-converting decode, then the default
        ("f16", 640, 12_756),
        ("f16", 640, 12_801),  # session 32, decode_fp8_mma=0, two calls
        ("f16", 640, 12_879),
    ],
)
def test_issue_12_workload_within_five_percent_of_the_h200(
    tmp_path, monkeypatch, kernel, seqs, measured
):
    monkeypatch.setattr(quantized, "FP8_KV_FACTOR", KERNELS[kernel])
    assert abs(_simulated(tmp_path, kernel, seqs) / measured - 1) < 0.05


@pytest.mark.parametrize(
    ("after", "before", "gain", "within"),
    [
        # session 32, one H200, the same calls with decode_fp8_mma on and off: 13,463 /
        # 12,879 and 13,265 / 12,801, a gain of 3.6-4.5%
        ("mma", "f16", 1.04, 0.02),
        # session 38, one H200, decode_fp8_fold on and off: 14,089 / 13,627 and 14,093 /
        # 13,658, a gain of 3.2-3.4%
        ("today", "tiles", 1.033, 0.01),
    ],
)
def test_each_decode_kernel_s_gain_matches_the_h200_s(
    tmp_path, monkeypatch, after, before, gain, within
):
    monkeypatch.setattr(quantized, "FP8_KV_FACTOR", KERNELS[after])
    new = _simulated(tmp_path, after)
    monkeypatch.setattr(quantized, "FP8_KV_FACTOR", KERNELS[before])
    old = _simulated(tmp_path, before)
    assert abs(new / old - gain) < within


def test_blocks_of_64_gain_about_what_the_h100_measured(tmp_path):
    # session 51, one H100, the issue's workload (about 480 of the 600 resident there):
    # 11,554.9 out tok/s in blocks of 16, 12,235.1 in blocks of 64 (+5.9%); the lab
    # models the H200 with the decode kernel's per-layer gain measured on the H100
    ratio = _simulated(tmp_path, "b64", block_size=64) / _simulated(tmp_path, "b16")
    assert 1.03 < ratio < 1.09
