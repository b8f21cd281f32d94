"""Workloads for the simulator and for ``bench serve --trace``: who arrives when, with
how many prompt tokens, wanting how many output tokens.

Three sources, one result (a list of ``TraceRequest`` sorted by arrival):
- synthetic: Poisson or gamma arrivals (``cv`` > 1 is burstier than Poisson),
  lengths fixed, uniform, or lognormal around a mean;
- Azure's public LLM inference traces (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``);
- the server's own request log (``tokenloom serve --record-trace FILE``, JSONL).

Priorities and tenants can be drawn onto any of them (``assign_classes``); time
scaling (``speed``: 2 replays twice as fast) and a target request rate rescale the
arrival times only, never the lengths.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import msgspec

AZURE_CODE_TRACE = "azure-llm-2023-code.csv"  # shipped beside this module, in data/


def make_workload(
    num: int, low: int, high: int, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """``tokenloom bench throughput``'s offline workload: ``num`` requests of random
    token ids, input and output lengths uniform in ``low..high`` (the lab simulates the
    same requests: ``sim.derived.simulated_throughput``)."""
    rng = random.Random(seed)
    top = min(vocab, 32000) - 1
    work = []
    for _ in range(num):
        n_in, n_out = rng.randint(low, high), rng.randint(low, high)
        work.append(([rng.randint(10, top) for _ in range(n_in)], n_out))
    return work


class TraceRequest(msgspec.Struct, omit_defaults=True):
    """One request of a workload; also one line of a recorded trace (JSONL)."""

    arrival_s: float  # seconds since the trace's first request
    prompt_len: int
    output_len: int
    priority: int = 0
    tenant: str = ""
    finish_reason: str = ""  # recorded traces: how the request ended on the server
    deadline_s: float | None = None  # the engine aborts it this long after arrival


def synthetic(
    num_requests: int,
    rate: float,
    *,
    prompt_len: int = 512,
    output_len: int = 128,
    length_dist: str = "fixed",
    cv: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_requests`` arriving at ``rate`` per second (inf: all at once); gaps are
    gamma with coefficient of variation ``cv`` (1 = Poisson). ``length_dist``:
    fixed, uniform (0.5x..1.5x the mean) or lognormal (sigma 1, same mean)."""
    rng = random.Random(seed)
    clock = 0.0
    out = []
    for _ in range(num_requests):
        out.append(
            TraceRequest(
                clock,
                _draw(prompt_len, length_dist, rng),
                _draw(output_len, length_dist, rng),
            )
        )
        if math.isfinite(rate):
            shape = 1.0 / (cv * cv)
            clock += rng.gammavariate(shape, 1.0 / (rate * shape))
    return out


def _draw(mean: int, dist: str, rng: random.Random) -> int:
    if dist == "fixed":
        return mean
    if dist == "uniform":
        return rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))
    if dist == "lognormal":
        sigma = 1.0
        return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
    raise ValueError(f"length distribution: fixed, uniform or lognormal; got {dist!r}")


def load_azure_csv(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """An Azure LLM inference trace: ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    out = []
    first = None
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            stamp = _timestamp(row["TIMESTAMP"])
            first = stamp if first is None else first
            out.append(
                TraceRequest(
                    stamp - first,
                    max(1, int(row["ContextTokens"])),
                    max(1, int(row["GeneratedTokens"])),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def _timestamp(text: str) -> float:
    # Azure writes 7 fractional digits; fromisoformat takes at most 6.
    head, dot, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if dot else head).timestamp()


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    """A recorded trace: one ``TraceRequest`` object per line."""
    decoder = msgspec.json.Decoder(TraceRequest)
    with open(path, "rb") as handle:
        out = [decoder.decode(line) for line in handle if line.strip()]
    out.sort(key=lambda r: r.arrival_s)
    if out and out[0].arrival_s:
        first = out[0].arrival_s
        out = [msgspec.structs.replace(r, arrival_s=r.arrival_s - first) for r in out]
    return out


def load_trace(path: str | Path, limit: int | None = None, skip: int = 0) -> list[TraceRequest]:
    """A trace by its format: ``.csv`` (Azure) or JSONL (recorded); ``azure-code``
    names the shipped Azure code trace. ``skip`` drops the first requests (a window
    of the trace then starts at its first request, at time 0)."""
    if str(path) == "azure-code":
        path = Path(__file__).parent / "data" / AZURE_CODE_TRACE
    if str(path).endswith(".csv"):
        trace = load_azure_csv(path, None if limit is None else skip + limit)
    else:
        trace = load_jsonl(path)
    trace = trace[skip:] if limit is None else trace[skip : skip + limit]
    if trace and trace[0].arrival_s:
        first = trace[0].arrival_s
        trace = [msgspec.structs.replace(r, arrival_s=r.arrival_s - first) for r in trace]
    return trace


def write_jsonl(trace: Sequence[TraceRequest], path: str | Path) -> None:
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as handle:
        for request in trace:
            handle.write(encoder.encode(request) + b"\n")


def rescale(
    trace: Sequence[TraceRequest], *, speed: float = 1.0, rate: float | None = None
) -> list[TraceRequest]:
    """Arrivals ``speed`` times faster, or scaled so the mean rate is ``rate`` req/s
    (the gaps keep their shape either way). Lengths are unchanged."""
    if not trace:
        return []
    span = trace[-1].arrival_s - trace[0].arrival_s
    if rate is not None:
        if span <= 0:
            raise ValueError("cannot set the rate of a trace whose requests all arrive at once")
        speed = rate / ((len(trace) - 1) / span)
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s / speed) for r in trace]


def assign_classes(
    trace: Sequence[TraceRequest],
    *,
    priorities: dict[int, float] | None = None,
    tenants: int = 0,
    tenant_skew: float = 0.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Draw a priority (``{priority: weight}``) and a tenant (``t0..t{n-1}``, Zipf
    weights ``1/(i+1)**tenant_skew``; 0 = uniform) for each request."""
    rng = random.Random(seed)
    prio_values = list(priorities or {})
    prio_weights = [priorities[p] for p in prio_values] if priorities else []
    names = [f"t{i}" for i in range(tenants)]
    tenant_weights = [1.0 / (i + 1) ** tenant_skew for i in range(tenants)]
    out = []
    for r in trace:
        changes: dict[str, object] = {}
        if prio_values:
            changes["priority"] = rng.choices(prio_values, prio_weights)[0]
        if names:
            changes["tenant"] = rng.choices(names, tenant_weights)[0]
        out.append(msgspec.structs.replace(r, **changes) if changes else r)
    return out


def describe(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Size and load of a workload, for the report."""
    if not trace:
        return {"requests": 0}
    span = trace[-1].arrival_s - trace[0].arrival_s
    return {
        "requests": len(trace),
        "duration_s": span,
        "rate_req_s": (len(trace) - 1) / span if span > 0 else math.inf,
        "mean_prompt_len": sum(r.prompt_len for r in trace) / len(trace),
        "mean_output_len": sum(r.output_len for r in trace) / len(trace),
    }
