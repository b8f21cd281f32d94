"""``tokenloom bench serve``: load an OpenAI-compatible server and measure latency.

Sends ``--num-prompts`` streamed /v1/completions requests of random token ids
(lengths uniform in ``len * (1 +- range_ratio)``, ``ignore_eos`` so outputs have
their chosen length), either arriving as a Poisson process of ``--request-rate``
per second (``inf``: all at once) or ``--max-concurrency`` at a time. Reports TTFT,
TPOT, ITL and end-to-end latency (mean, p50, p90, p99) and request and token
throughput; prints a table and writes JSON. Works against any server that accepts
token-id prompts (tokenloom, vLLM, SGLang, ...).

``--trace FILE`` replays a workload instead (an Azure CSV, a JSONL request log of
``tokenloom serve --record-trace``, or ``azure-code``, the trace ``tokenloom sim``
ships): each request is sent at its arrival time (``--speed`` / ``--trace-rate``
rescale them, as in ``tokenloom sim``) with its prompt length (random ids), its
output length (``max_tokens``, EOS ignored), its priority and its tenant (``user``).
Trace requests ask for ``logprobs: 0`` (every token then arrives as a chunk, even
one whose text is held back) and the engine's ``metrics`` (queue time, preemptions).
The JSON then also holds ``trace_summary``, computed by ``tokenloom.sim.metrics``
exactly as the simulator's, so the two compare figure by figure
(``python -m tokenloom.sim.compare``). HTTP is spoken by ``bench.http_stream``
(standard library only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenloom.bench.common import print_table, write_json

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0  # tokens generated, from usage
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float = 0.0  # seconds since the benchmark started
    priority: int = 0
    tenant: str = ""
    engine_metrics: dict[str, Any] | None = None  # the server's "metrics" extra, if sent


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenloom bench serve", description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = burst")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--token-range", default="100:1000", help="random prompt ids lo:hi")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="prompt ids; a second run with the same seed against the same server hits its "
        "prefix cache (use another seed to measure prefill again)",
    )
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="ask each token's logprob, so that every token streams as a chunk: TTFT and "
        "TPOT then count tokens, not visible text (needed on random weights, whose tokens "
        "often decode to empty text; a trace replay always asks)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="JSON output file")
    trace = parser.add_argument_group("trace replay")
    trace.add_argument("--trace", default=None, help="CSV (Azure), JSONL (recorded) or azure-code")
    trace.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    trace.add_argument("--skip", type=int, default=0, help="start the trace after N requests")
    trace.add_argument("--speed", type=float, default=1.0, help="replay N times faster")
    trace.add_argument("--trace-rate", type=float, default=None, help="rescale to this req/s")
    trace.add_argument("--slo-ttft-ms", type=float, default=None)
    trace.add_argument("--slo-tpot-ms", type=float, default=None)
    args = parser.parse_args(argv)
    if not 0.0 <= args.range_ratio < 1.0:
        parser.error("--range-ratio must be in [0, 1)")
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0")
    return args


def sample_lengths(mean: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    # A request whose tokens all decoded to empty text (random weights do that; a
    # synthetic run asks no logprobs) never showed a first token: its TTFT is unknown,
    # not 0, and it is left out of the latency figures (counted apart).
    seen = [r for r in done if r.ttft > 0.0]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in seen if r.output_len > 1]
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "no_visible_token": len(done) - len(seen),
    }
    for name, values in (
        ("ttft_ms", [r.ttft for r in seen]),
        ("tpot_ms", tpot),
        ("itl_ms", [gap for r in done for gap in r.itl]),
        ("e2e_ms", [r.e2e for r in done]),
    ):
        summary[name] = _stats([v * 1000 for v in values])
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    ordered = sorted(values)
    stats = {"mean": statistics.fmean(ordered)}
    for p in PERCENTILES:
        stats[f"p{p}"] = ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]
    return stats


async def send_one(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    """One streamed completion; times every content chunk."""
    result = RequestResult(ok=False, prompt_len=len(body["prompt"]))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("metrics"):
                    result.engine_metrics = chunk["metrics"]
                # A token arrives as text, or (asked with logprobs) as its logprob even
                # when its text is held back (random weights often sample ids whose
                # text is empty or partial UTF-8).
                if not any(c.get("text") or c.get("logprobs") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # a benchmark reports failures; it does not stop on them
        result.error = repr(exc)
    return result


def load_workload(args: argparse.Namespace, rng: random.Random) -> list[Any]:
    """The requests to send, as ``sim.workload.TraceRequest`` (arrival 0 = at once
    without a trace; gaps then come from ``--request-rate``)."""
    from tokenloom.sim.workload import TraceRequest, load_trace, rescale

    if args.trace:
        trace = load_trace(args.trace, args.limit, args.skip)
        return rescale(trace, speed=args.speed, rate=args.trace_rate)
    input_lens = sample_lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    output_lens = sample_lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    return [
        TraceRequest(0.0, n_in, n_out) for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tokenloom.bench.http_stream import AsyncClient

    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_range.split(":"))
    work = load_workload(args, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with AsyncClient(args.base_url, headers=headers, timeout=args.timeout_s) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = []
        for request in work:
            body = {
                "model": model,
                "prompt": [rng.randrange(lo, hi) for _ in range(request.prompt_len)],
                "max_tokens": request.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if request.priority:
                body["priority"] = request.priority
            if request.tenant:
                body["user"] = request.tenant
            if args.trace or args.logprobs:  # every token as a chunk
                body["logprobs"] = 0
            if args.trace:  # and the engine's own timings
                body["include_metrics"] = True
            bodies.append(body)
        gate = asyncio.Semaphore(args.max_concurrency or len(bodies))

        async def limited(body: dict[str, Any], sent_at: float, request: Any) -> RequestResult:
            async with gate:
                result = await send_one(client, "/v1/completions", body)
            result.sent_at, result.priority, result.tenant = (
                sent_at,
                request.priority,
                request.tenant,
            )
            return result

        start = time.perf_counter()
        tasks = []
        for body, request in zip(bodies, work, strict=True):
            if args.trace:  # honour the arrival times
                delay = start + request.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            sent_at = time.perf_counter() - start
            tasks.append(asyncio.create_task(limited(body, sent_at, request)))
            if not args.trace and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    if args.trace:
        summary["trace_summary"] = trace_summary(list(results), args)
    summary["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    summary["config"]["model"] = model
    errors = [r.error for r in results if not r.ok]
    summary["errors"] = errors[:10]
    summary["requests"] = [asdict(r) | {"itl": None} for r in results]
    return summary


def trace_summary(results: list[RequestResult], args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's summary (``sim.metrics.summarize``) of a real replay."""
    from tokenloom.sim.metrics import summarize as sim_summarize
    from tokenloom.sim.simulator import RequestRecord

    records = []
    for r in results:
        record = RequestRecord(r.sent_at, r.prompt_len, r.output_len, r.priority, r.tenant)
        if r.ok and r.output_len:
            record.first_token = r.sent_at + r.ttft
            record.finished = r.sent_at + r.e2e
            record.num_output = r.output_len
            record.finish_reason = "length"
            engine = r.engine_metrics or {}
            if engine.get("queue_time") is not None:  # the engine's arrival to first scheduled
                record.started = r.sent_at + engine["queue_time"]
            record.preemptions = int(engine.get("num_preemptions") or 0)
        else:
            record.finish_reason = "rejected" if r.error.startswith("HTTP 4") else "error"
        records.append(record)
    return sim_summarize(records, args.slo_ttft_ms, args.slo_tpot_ms)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    summary = asyncio.run(run_benchmark(args))
    rows: list[tuple[str, Any]] = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", summary["duration_s"]),
        ("request throughput (req/s)", summary["request_throughput"]),
        ("output token throughput (tok/s)", summary["output_token_throughput"]),
        ("total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    if summary["no_visible_token"]:
        rows.append(("no visible token (left out of TTFT/TPOT)", summary["no_visible_token"]))
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[name]
        rows.append((f"{name} mean/p50/p90/p99", " / ".join(f"{v:.2f}" for v in stats.values())))
    if "trace_summary" in summary:
        trace = summary["trace_summary"]
        rows += [
            ("trace: requests / completed", f"{trace['requests']} / {trace['completed']}"),
            ("trace: goodput (req/s within SLO)", trace["goodput_req_s"]),
        ]
    print_table(f"serving benchmark: {args.base_url}", rows)
    for error in summary["errors"]:
        print(f"error: {error}")
    write_json(args.out, "bench-serve.json", summary)
    return 0 if summary["completed"] else 1
