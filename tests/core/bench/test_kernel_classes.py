"""``scripts/kernel_classes.py`` (the profiling scripts' floors): quantized settings shrink
the weight and KV bytes of the floors, and a profile whose kernels overlap (PDL) says so
instead of presenting waiting time as work."""

from __future__ import annotations

import pytest
from script_module import load

PEAKS = {"copy_bytes_s": 4.0e12, "bf16_flop_s": 800e12}


@pytest.fixture(scope="module")
def kc():
    return load("kernel_classes")


def test_byte_scales_follow_the_engine_settings(kc):
    assert kc.byte_scales(None, None) == {"weight_byte_scale": 1.0, "kv_byte_scale": 1.0}
    assert kc.byte_scales("int8", "auto") == {"weight_byte_scale": 0.5, "kv_byte_scale": 1.0}
    assert kc.byte_scales("int4", "fp8") == {"weight_byte_scale": 0.28, "kv_byte_scale": 0.5}


def test_quantized_weights_lower_the_gemm_floor_but_not_the_lm_head(kc):
    dense = kc.floors("llama-3-8b", 1, 148, PEAKS)["gemm"]["bytes"]
    int8 = kc.floors("llama-3-8b", 1, 148, PEAKS, **kc.byte_scales("int8", None))["gemm"]
    head = 2.0 * 128256 * 4096  # kept 16-bit
    assert int8["bytes"] == pytest.approx((dense - head) * 0.5 + head)
    assert int8["floor_us"] == pytest.approx(int8["bytes"] / PEAKS["copy_bytes_s"] * 1e6)


def test_overlapping_kernels_are_flagged(kc, capsys):
    step = kc.floors("llama-3-8b", 1, 148, PEAKS)
    kc.print_class_table({"gemm": 3000.0, "norm": 900.0}, step, 2500.0)
    assert "kernels overlap" in capsys.readouterr().out
    kc.print_class_table({"gemm": 2000.0, "norm": 100.0}, step, 2500.0)
    assert "kernels overlap" not in capsys.readouterr().out


def test_critical_times_charge_each_kernel_with_what_it_added_to_the_span(kc):
    # PDL: each kernel starts inside the one before and waits; durations overlap
    kernels = [("norm", 0, 5), ("gemv", 1, 20), ("rope", 15, 21), ("attn", 18, 27)]
    timed = kc.critical_times(kernels)
    assert timed == [("norm", 5), ("gemv", 15), ("rope", 1), ("attn", 6)]
    assert sum(us for _, us in timed) == 27  # the span, from the first start
    # a kernel that ends before the latest end so far added nothing; a gap counts
    assert kc.critical_times([("a", 0, 10), ("b", 2, 8), ("c", 12, 13)]) == [
        ("a", 10),
        ("b", 0),
        ("c", 3),
    ]


def test_layer_positions_count_from_each_attention_launch(kc):
    timed = [("embed", 2), ("_decode_kernel", 4), ("gemv", 10), ("_decode_kernel", 6), ("gemv", 12)]
    rows = kc.by_layer_position(timed, steps=1)
    assert rows == [
        (-1, "embed", 1.0, 2.0),
        (0, "_decode_kernel", 2.0, 5.0),
        (1, "gemv", 2.0, 11.0),
    ]


def test_every_attention_kernel_is_classed_as_attention(kc):
    # the fp8-MMA decode (an fp8 cache's default since session 32) fell into "other"
    # in session 37's H200 profile until its name was added
    for name in ("_decode_kernel", "_decode_fp8_mma_kernel", "_prefill_kernel"):
        assert kc.classify(name) == "attention"
    assert kc.classify("_per_token_fp8_row_kernel") == "quantize"
