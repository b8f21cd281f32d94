"""Kernel classes of a profiled step, against the floor of each class.

Shared by the profiling scripts (``profile_throughput.py``, ``profile_gpu.py``): it
sorts the CUDA kernels of a torch.profiler run into GEMM / attention / norm / rope+KV /
activation / quantize / sampling / other by name, and sets each class's time per step
beside what its bytes (at the measured copy bandwidth) or FLOPs (at the measured
dense-GEMM rate) allow. The floors come from the model shape (``ModelShape``), not
from the kernels, so a kernel that moves more than it must shows as a gap.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch

CLASSES = (
    ("gemm", r"nvjet|cutlass|gemm|gemv|xmma|splitkreduce|_skinny|matmul|_mm_|scaled_mm"),
    ("attention", r"_decode_kernel|_decode_fp8_mma|_prefill|attn|attention|flash"),
    ("norm", r"rms_norm|layer_norm"),
    ("rope+kv", r"rope|kv_write|_write_quantized_kv|_store_quantized"),
    ("activation", r"silu|gelu"),
    ("quantize", r"_per_token_fp8|quant"),
    (
        "sampling",
        r"softmax|exponential|argmax|argmin|reduce_kernel|reduce_splits|_sample|gumbel|topk|sort",
    ),
)


def classify(name: str) -> str:
    lowered = name.lower()
    for cls, pattern in CLASSES:
        if re.search(pattern, lowered):
            return cls
    return "other"


def measure_peaks(quant: str | None = None) -> dict[str, float]:
    """The copy bandwidth (bytes/s) and the bf16 (and fp8) dense GEMM rate (FLOP/s) of
    this GPU, measured now: median of 10 timed runs each, after a warm-up."""
    from tokenloom.plugins.models.cuda_timing import median_cuda_us

    def median_ms(fn) -> float:
        return median_cuda_us(fn, iters=10) / 1e3

    buffers = [torch.empty(2 << 30, dtype=torch.uint8, device="cuda") for _ in range(2)]
    copy_ms = median_ms(lambda: buffers[1].copy_(buffers[0]))
    peaks = {"copy_bytes_s": 2 * buffers[0].numel() / (copy_ms / 1e3)}  # read + write
    buffers.clear()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    peaks["bf16_flop_s"] = 2 * n**3 / (median_ms(lambda: a @ b) / 1e3)
    if quant == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        peaks["fp8_flop_s"] = (
            2
            * n**3
            / (
                median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
                / 1e3
            )
        )
    torch.cuda.empty_cache()
    return peaks


def class_times(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """``kernels``: (name, microseconds) per kernel launch; -> us per step by class."""
    totals: dict[str, float] = defaultdict(float)
    for name, us in kernels:
        totals[classify(name)] += us / steps
    return dict(totals)


def byte_scales(quant: str | None, kv_cache_dtype: str | None) -> dict[str, float]:
    """``floors``' byte scales for an engine setting: 8-bit weights or KV take half the
    bytes, int4 about 0.28 (4 bits plus a 16-bit scale and zero point per 128)."""
    weight = {"fp8": 0.5, "int8": 0.5, "int4": 0.28}.get(quant or "none", 1.0)
    kv = 0.5 if kv_cache_dtype in ("fp8", "int8") else 1.0
    return {"weight_byte_scale": weight, "kv_byte_scale": kv}


def floors(
    shape: str,
    num_seqs: int,
    context: int,
    peaks: dict[str, float],
    weight_byte_scale: float = 1.0,
    kv_byte_scale: float = 1.0,
    flop_rate: float | None = None,
) -> dict[str, dict[str, float]]:
    """Floors (us) of one decode step of ``num_seqs`` rows at ``context`` tokens each:
    the GEMMs' weight bytes (the LM head kept 16-bit) or FLOPs, whichever is larger,
    and the attention's KV bytes. ``*_byte_scale`` shrink the bytes for quantization
    (0.5 for 8-bit weights or KV)."""
    from tokenloom.checkpoints.model_shapes import SHAPES
    from tokenloom.sim.cost_model import ModelShape

    s = ModelShape.named(shape)
    cfg = SHAPES[shape]
    head_bytes = 2.0 * cfg["vocab_size"] * cfg["hidden_size"]
    gemm_bytes = (s.weight_bytes - head_bytes) * weight_byte_scale + head_bytes
    gemm_flops = num_seqs * (s.flops_per_token + s.head_flops)
    rate = flop_rate or peaks["bf16_flop_s"]
    kv_bytes = num_seqs * context * s.kv_bytes_per_token * kv_byte_scale
    bw = peaks["copy_bytes_s"]
    return {
        "gemm": {
            "bytes": gemm_bytes,
            "flops": gemm_flops,
            "floor_us": max(gemm_bytes / bw, gemm_flops / rate) * 1e6,
        },
        "attention": {"bytes": kv_bytes, "floor_us": kv_bytes / bw * 1e6},
    }


def print_class_table(
    per_step: dict[str, float], step_floors: dict[str, dict[str, float]], span_us: float
) -> dict[str, Any]:
    """Prints us per step by class, beside the floors; returns the same as a dict."""
    busy = sum(per_step.values())
    print(f"{'class':<12}{'us/step':>10}{'share':>8}{'floor us':>10}{'% of floor':>11}")
    rows = {}
    for cls in sorted(per_step, key=lambda c: -per_step[c]):
        us = per_step[cls]
        floor = step_floors.get(cls, {}).get("floor_us")
        pct = f"{100 * floor / us:.0f}%" if floor else "-"
        print(f"{cls:<12}{us:>10.1f}{100 * us / busy:>7.1f}%{floor or 0:>10.1f}{pct:>11}")
        rows[cls] = {"us": us, "floor_us": floor}
    total_floor = sum(f["floor_us"] for f in step_floors.values())
    if busy > span_us:
        print(
            "kernels overlap (PDL launches each kernel early, to wait in it): the class "
            "times include waiting, so they overstate and % of floor understates"
        )
    print(
        f"kernels busy {busy:.1f} us/step, step span {span_us:.1f} us, "
        f"gaps {span_us - busy:.1f} us; sum of class floors {total_floor:.1f} us "
        f"({100 * total_floor / span_us:.0f}% of the span)"
    )
    return {"classes": rows, "busy_us": busy, "span_us": span_us, "floor_us": total_floor}


def critical_times(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """``kernels``: (name, start, end) in start order -> (name, us) per launch: how far
    each kernel moved the latest end so far. Under PDL a kernel starts early and waits in
    itself, so its duration overstates; its end cannot come before the end of the
    kernel it waits on, so these increments add up to the span and charge each kernel
    with the time it kept the stream going (its work after the wait, plus any gap)."""
    result = []
    latest = kernels[0][1] if kernels else 0.0
    for name, _, end in kernels:
        result.append((name, max(0.0, end - latest)))
        latest = max(latest, end)
    return result


def by_layer_position(
    timed: list[tuple[str, float]], steps: int, anchor: str = "_decode_kernel"
) -> list[tuple[int, str, float, float]]:
    """Per kernel position after each ``anchor`` launch (the decode attention: one per
    layer): (position, name, launches per step, mean us), in position order. A layer's
    kernels come at positions 0..period-1; launches once per step (the LM head, the
    sampler) show with a count of about 1."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    position = -1
    for name, us in timed:
        position = 0 if anchor in name else position + 1 if position >= 0 else -1
        sums[(position, name)].append(us)
    rows = [(p, n, len(v) / steps, sum(v) / len(v)) for (p, n), v in sums.items()]
    return sorted(rows)
