"""Per-kernel GPU time of single-stream decode steps (torch.profiler), eager and graphs.
Usage: python scripts/profile_gpu.py [MODEL_SHAPE] [graphs] [KEY=VALUE ...]  (graphs: skip
eager; KEY=VALUE: engine settings, e.g. quant=int4)
Prints the kernel table, the step's busy time and gaps, and the kernel classes against
their floors (``kernel_classes.py``); with OUT set, writes profile-gpu-SHAPE.json there."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from kernel_classes import (
    by_layer_position,
    byte_scales,
    class_times,
    critical_times,
    floors,
    measure_peaks,
    print_class_table,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.model_shapes import write_shape_dir
from tokenloom.protocols.requests import GenerateRequest

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
settings = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
model_dir = str(write_shape_dir(shape, tempfile.mkdtemp()))
for eager in (False,) if "graphs" in sys.argv[2:] else (True, False):
    llm = LLM(model_dir, load_format="random", max_num_seqs=8, enforce_eager=eager, **settings)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request(GenerateRequest("r", list(range(10, 138)), params))
    for _ in range(10):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
    print(f"===== eager={eager}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=24))
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 20 / 1e3
    print(f"device time per step: {total:.3f} ms over {len(events)} kernel kinds")
    # The timeline: how much of each step the device is busy, and where it waits.
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    busy = sum(k.time_range.end - k.time_range.start for k in kernels) / 20
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 20
    gaps = [
        (max(0.0, b.time_range.start - a.time_range.end), a.name[:40], b.name[:40])
        for a, b in zip(kernels, kernels[1:], strict=False)
    ]
    small = [g for g in gaps if g[0] <= 20]
    big = sorted((g for g in gaps if g[0] > 20), reverse=True)
    print(
        f"per step: span {span:.0f} us, kernels busy {busy:.0f} us, "
        f"{len(small) / 20:.0f} gaps <= 20 us totalling {sum(g[0] for g in small) / 20:.0f} us, "
        f"{len(big) / 20:.1f} gaps > 20 us totalling {sum(g[0] for g in big) / 20:.0f} us"
    )
    for gap in big[:6]:
        print(f"  gap {gap[0]:.0f} us after {gap[1]} before {gap[2]}")
    peaks = measure_peaks()
    print("peaks: " + ", ".join(f"{k} {v / 1e12:.1f} T" for k, v in peaks.items()))
    per_step = class_times([(k.name, k.time_range.end - k.time_range.start) for k in kernels], 20)
    # 128 prompt tokens, then 10 warm-up steps and 20 profiled: mean context ~148
    scales = byte_scales(settings.get("quant"), settings.get("kv_cache_dtype"))
    summary = print_class_table(per_step, floors(shape, 1, 148, peaks, **scales), span)
    # The critical path: what each kernel added to the step (PDL overlaps durations)
    timed = critical_times([(k.name, k.time_range.start, k.time_range.end) for k in kernels])
    critical = class_times(timed, 20)
    print("critical path per step by class: " + ", ".join(
        f"{c} {us:.0f} us" for c, us in sorted(critical.items(), key=lambda x: -x[1])
    ))  # fmt: skip
    positions = by_layer_position(timed, 20)
    print(f"{'pos':>4}{'per step':>9}{'us':>8}  kernel (critical time, mean per launch)")
    for pos, name, count, us in positions:
        if count * us >= 1.0:  # at least 1 us a step
            print(f"{pos:>4}{count:>9.1f}{us:>8.2f}  {name[:70]}")
    summary.update(shape=shape, eager=eager, peaks=peaks, kernels_per_step=len(kernels) / 20)
    summary.update(critical_us=critical, positions=positions)
    if os.environ.get("OUT"):
        tag = "".join(f"-{k}{v}" for k, v in settings.items())
        name = f"profile-gpu-{shape}{tag}{'-eager' if eager else ''}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(summary, f, indent=2)
    engine.abort(["r"])
    engine.shutdown()
    del llm, engine
    torch.cuda.empty_cache()
