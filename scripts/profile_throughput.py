"""Where the time of the offline throughput workload goes, step by step.

Runs the ``tokenloom bench throughput`` workload through ``Engine.step`` and times,
per step, the host phases (schedule, execute, update, output processing) and the
GPU time of the step (CUDA events around execute). Prints totals per step class
(decode-only by batch bucket, mixed prefill by token bucket), then a torch.profiler
kernel table of a few large decode steps and one mixed step.

Usage: python scripts/profile_throughput.py [MODEL_SHAPE] [NUM_PROMPTS] [key=value ...]
(key=value are engine options, e.g. async_scheduling=false). Environment: MIN_LEN /
MAX_LEN (the workload's input and output lengths, default 100 / 1024, as the bench),
PROF_SEQS / PROF_CTX (the profiled decode steps: rows and context, default 128 / 600),
KERNELS=0 skips the kernel tables. The kernel classes of the decode steps are printed
against their floors (``kernel_classes.py``: the GEMMs' weight bytes or FLOPs, the
attention's KV bytes, at the copy bandwidth and GEMM rate measured first).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from kernel_classes import byte_scales, class_times, floors, measure_peaks, print_class_table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.model_shapes import write_shape_dir
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.sim.workload import make_workload


def parse(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        return value


shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
num_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 256
options = dict(arg.split("=", 1) for arg in sys.argv[3:])
if os.path.isdir(shape):  # a model directory (tests, the CPU)
    llm = LLM(shape, **{k: parse(v) for k, v in options.items()})
    shape = os.path.basename(shape.rstrip("/"))
else:
    llm = LLM(
        str(write_shape_dir(shape, tempfile.mkdtemp())),
        load_format="random",
        **{k: parse(v) for k, v in options.items()},
    )
engine = llm.engine
MIN_LEN, MAX_LEN = int(os.environ.get("MIN_LEN", 100)), int(os.environ.get("MAX_LEN", 1024))
PROF_SEQS, PROF_CTX = int(os.environ.get("PROF_SEQS", 128)), int(os.environ.get("PROF_CTX", 600))
work = make_workload(num_prompts, MIN_LEN, MAX_LEN, engine.info.vocab_size, 0)

scheduler, executor = engine.scheduler, engine.executor
timing = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
CUDA = torch.cuda.is_available()


class HostEvent:  # stands in for torch.cuda.Event on the CPU
    def __init__(self, **_):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


Event = torch.cuda.Event if CUDA else HostEvent
events: list[tuple] = []


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timing[name] += time.perf_counter() - t0
        return out

    return wrapper


orig_schedule, orig_update = scheduler.schedule, scheduler.update
scheduler.schedule = timed("schedule", orig_schedule)
scheduler.update = timed("update", orig_update)
submit = executor.submit  # the model runner's execute calls submit: timed once


def timed_submit(step):
    start, end = Event(enable_timing=True), Event(enable_timing=True)
    info = {"tokens": sum(len(c.token_ids) for c in step.chunks), "seqs": len(step.chunks)}
    t0 = time.perf_counter()
    start.record()
    out = submit(step)
    end.record()
    timing["execute"] += time.perf_counter() - t0
    events.append((start, end, info))
    return out


executor.submit = timed_submit

# Warm-up as the benchmark does (compiles what start-up did not).
llm.generate(
    [ids for ids, _ in work[:4]],
    SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
    use_tqdm=False,
)
params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for _, n in work]
for i, ((ids, _), p) in enumerate(zip(work, params, strict=True)):
    engine.add_request(GenerateRequest(f"r{i}", ids, p))
sync()
started = time.perf_counter()
process = 0.0
num_steps = 0
out_tokens = 0
while engine.has_unfinished():
    deltas = engine.step()
    t0 = time.perf_counter()
    for d in deltas:
        out_tokens += len(d.new_token_ids)
    llm.processor.process(deltas)
    process += time.perf_counter() - t0
    num_steps += 1
sync()
wall = time.perf_counter() - started

classes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
for start, end, info in events:
    gpu = start.elapsed_time(end)
    if info["tokens"] == info["seqs"]:
        bucket = f"decode b<={1 << (max(info['seqs'] - 1, 0)).bit_length()}"
    else:
        bucket = f"mixed t<={1 << (max(info['tokens'] - 1, 0)).bit_length()}"
    c = classes[bucket]
    c["steps"] += 1
    c["gpu_ms"] += gpu
    c["tokens"] += info["tokens"]
    c["seqs"] += info["seqs"]
print(f"\n== {shape}, {num_prompts} prompts, options {options}")
print(f"wall {wall:.2f}s, {num_steps} steps, {out_tokens / wall:,.0f} out tok/s")
print(
    "host s: " + ", ".join(f"{k} {v:.2f}" for k, v in timing.items()) + f", process {process:.2f}"
)
print(f"{'class':<18}{'steps':>7}{'gpu_s':>8}{'ms/step':>9}{'tok/step':>10}")
for name in sorted(classes, key=lambda n: (n[0], int(n.split("=")[1]))):
    c = classes[name]
    print(
        f"{name:<18}{int(c['steps']):>7}{c['gpu_ms'] / 1e3:>8.2f}"
        f"{c['gpu_ms'] / c['steps']:>9.2f}{c['tokens'] / c['steps']:>10.0f}"
    )
summary: dict = {
    "shape": shape,
    "lengths": [MIN_LEN, MAX_LEN],
    "options": options,
    "wall_s": wall,
    "steps": num_steps,
    "out_tok_s": out_tokens / wall,
    "host_s": {**timing, "process": process},
    "classes": {k: dict(v) for k, v in classes.items()},
}
out_dir = os.environ.get("OUT", ".")
tag = (
    "-".join(
        [f"len{MIN_LEN}-{MAX_LEN}"] * ((MIN_LEN, MAX_LEN) != (100, 1024))
        + [f"{k}{v}" for k, v in options.items()]
    )
    or "default"
)
with open(os.path.join(out_dir, f"profile-throughput-{shape}-{tag}.json"), "w") as f:
    json.dump(summary, f, indent=2)

if CUDA and os.environ.get("KERNELS", "1") == "1":
    # Kernel table: PROF_SEQS decodes at ~PROF_CTX context, then one 8192-token mixed step.
    scheduler.schedule, scheduler.update = orig_schedule, orig_update
    decode = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    profiled = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
    for i in range(PROF_SEQS):
        prompt = (work[i % len(work)][0] * (PROF_CTX // MIN_LEN + 2))[:PROF_CTX]
        prompt[0] = i  # distinct prompts: no prefix shared between the rows
        engine.add_request(GenerateRequest(f"d{i}", prompt, profiled))
    # Step until every row decodes (the prompts' prefill takes PROF_SEQS * PROF_CTX / 8192
    # steps), then a few more: the profiled steps are steady decode steps.
    # (At most max_num_seqs run at once; the step count is bounded in case rows never all
    # decode together, e.g. with speculation: the profile then says what it caught.)
    rows = min(PROF_SEQS, engine.config.max_num_seqs)
    steady, budget = 0, 4 * (PROF_SEQS * PROF_CTX // 8192 + 50)
    while steady < 4 and budget > 0:
        engine.step()
        budget -= 1
        last = events[-1][2]
        steady = steady + 1 if last["seqs"] == last["tokens"] == rows else 0
    num_profiled = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_profiled):
            engine.step()
        torch.cuda.synchronize()
    print(f"\n== {num_profiled} decode steps, batch {PROF_SEQS}, context ~{PROF_CTX}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / num_profiled
    quant = options.get("quant")
    peaks = measure_peaks(quant)
    print("peaks: " + ", ".join(f"{k} {v / 1e12:.0f} T" for k, v in peaks.items()))
    step_floors = floors(
        shape,
        PROF_SEQS,
        PROF_CTX + 30,  # about the mean context of the profiled steps
        peaks,
        **byte_scales(quant, options.get("kv_cache_dtype")),
        flop_rate=peaks.get("fp8_flop_s") if quant == "fp8" else None,
    )
    per_step = class_times(
        [(k.name, k.time_range.end - k.time_range.start) for k in kernels], num_profiled
    )
    summary["decode_profile"] = {
        "num_seqs": PROF_SEQS,
        "context": PROF_CTX,
        "peaks": peaks,
        "floors": step_floors,
        **print_class_table(per_step, step_floors, span),
    }
    with open(os.path.join(out_dir, f"profile-throughput-{shape}-{tag}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    engine.abort([f"d{i}" for i in range(PROF_SEQS)])
    while engine.has_unfinished():
        engine.step()
    # new prompts of the workload's lengths (another seed: the prefix cache holds the
    # run's), enough to fill a step's token budget; until session 37 eight of the run's
    # prompts, each doubled (twice the workload's causal attention per token)
    budget = engine.config.max_num_batched_tokens
    fresh = make_workload(
        budget // max(MIN_LEN, 1) + 1, MIN_LEN, MAX_LEN, engine.info.vocab_size, 1
    )
    num_prompts, filled = 0, 0
    while filled < budget and num_prompts < len(fresh):
        prompt = fresh[num_prompts][0]
        engine.add_request(GenerateRequest(f"p{num_prompts}", prompt, decode))
        num_prompts, filled = num_prompts + 1, filled + len(prompt)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    print(f"\n== one prefill step ({num_prompts} new prompts of the workload's lengths, "
          f"{filled} tokens, at most {budget} of them in the step)")  # fmt: skip
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
