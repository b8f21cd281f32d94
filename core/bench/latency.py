"""``tokenloom bench latency``: single-stream decode speed against the bandwidth roofline.

One request, a 128-token prompt, then greedy decode with EOS ignored. Each engine
step is timed on the host (a step ends with reading the sampled id, so its wall
time is real). The roofline is measured in the same run: a large device-to-device
copy gives the bandwidth; the bytes one decode step must read are the weights
(the embedding is a gather, so only an untied lm_head is read in full) plus the
KV cache at the mean context length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenloom.bench.common import (
    add_engine_args,
    engine_options,
    print_table,
    spec_summary,
    write_json,
)


def copy_bandwidth(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def bytes_per_step(engine: Any, context: float) -> float:
    model = engine.executor.model
    info = engine.info
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = getattr(model, "embed_tokens", None) or getattr(
        getattr(model, "model", None), "embed_tokens", None
    )
    tied = getattr(model, "lm_head", None) is embed
    # the embedding's 16-bit rows are gathered, not read in full, unless they are the
    # LM head's (tied, with no quantized copy for the logits: quant_lm_head)
    if embed is not None and (not tied or getattr(embed, "logits_kernel", None) is not None):
        weights -= embed.weight.numel() * embed.weight.element_size()
    element = 2 if str(info.dtype) in ("torch.bfloat16", "torch.float16") else 4
    # per rank under tensor parallelism: its weight shard (above) and its KV heads
    kv_heads = engine.executor.rank_info.num_kv_heads
    kv_per_token = 2 * info.num_layers * kv_heads * info.head_dim * element
    return weights + kv_per_token * context


def decode_run(engine: Any, prompt: list[int], output_len: int, request_id: str) -> list[float]:
    """Seconds from submission to each output token's arrival on the host (the
    same measure with and without async scheduling, whose steps return tokens one
    call later)."""
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(GenerateRequest(request_id, prompt, params))
    arrivals: list[float] = []
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter() - started
        arrivals += [now for d in deltas for _ in d.new_token_ids]
    return arrivals


def hf_decode_tokens_per_s(
    model_dir: str, random_weights: bool, prompt: list[int], output_len: int, runs: int = 3
) -> float:
    """transformers ``generate`` at batch 1, greedy, EOS ignored: decode tokens/s from the
    difference between ``output_len`` and one new token (prefill cancels), median of runs
    after a warm-up."""
    import torch

    from tokenloom.bench.throughput import hf_model

    model, device = hf_model(model_dir, random_weights)
    ids = torch.tensor([prompt], device=device)

    def timed(new: int) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        sync()
        return time.perf_counter() - started

    timed(8)
    decode_s = statistics.median(timed(output_len) - timed(1) for _ in range(runs))
    return (output_len - 1) / decode_s


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom bench latency", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--peer", choices=["none", "hf"], default="none", help="also time transformers generate"
    )
    args = parser.parse_args(argv)

    import torch

    from tokenloom import LLM

    options = engine_options(args)
    llm = LLM(**options)
    engine = llm.engine
    top = min(1000, engine.info.vocab_size - 10)
    prompt = [(7 * i + 11) % top + 10 for i in range(args.prompt_len)]
    # With a proposer the warm-up runs the full length: ``replay`` drafts from it.
    decode_run(engine, prompt, args.output_len if args.proposer != "none" else 16, "warmup")
    before = engine.stats()
    per_run = []
    for run in range(args.runs):
        arrivals = decode_run(engine, prompt, args.output_len, f"run-{run}")
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        per_run.append(
            {
                "ttft_ms": arrivals[0] * 1e3,
                "decode_tokens_per_s": len(gaps) / (arrivals[-1] - arrivals[0]),
                "step_ms_median": statistics.median(gaps) * 1e3,
            }
        )
    tok_s = statistics.median(r["decode_tokens_per_s"] for r in per_run)
    step_ms = statistics.median(r["step_ms_median"] for r in per_run)
    result: dict[str, Any] = {
        "model": args.model,
        "config": {k: v for k, v in options.items() if k != "model"},
        "runs": per_run,
        "decode_tokens_per_s": tok_s,
        "step_ms": step_ms,
        "memory_gib": dict(engine.executor.memory),
        "startup_s": dict(engine.executor.timings),
    }
    rows: list[tuple[str, Any]] = [
        ("decode tokens/s (median)", tok_s),
        ("ms per step (median)", step_ms),
        ("TTFT ms (median)", statistics.median(r["ttft_ms"] for r in per_run)),
    ]
    spec = spec_summary(before, engine.stats())
    if spec is not None:
        result["speculative"] = spec
        rows += [
            ("spec acceptance rate", spec["acceptance_rate"]),
            ("spec tokens per verify step", spec["mean_accepted_length"]),
        ]
    elif args.proposer != "none":  # a silent miss reads like a slow plain run
        result["speculative"] = None
        rows.append(("spec verify steps (none: no drafts)", 0))
    if torch.cuda.is_available():
        bandwidth = copy_bandwidth()
        step_bytes = bytes_per_step(engine, args.prompt_len + args.output_len / 2)
        roofline = bandwidth / step_bytes
        result.update(
            copy_bandwidth_gb_s=bandwidth / 1e9,
            bytes_per_step_gb=step_bytes / 1e9,
            roofline_tokens_per_s=roofline,
            percent_of_roofline=100 * tok_s / roofline,
        )
        rows += [
            ("copy bandwidth GB/s", bandwidth / 1e9),
            ("bytes per step GB", step_bytes / 1e9),
            ("roofline tokens/s", roofline),
            ("% of roofline", 100 * tok_s / roofline),
            (
                "graph capture s",
                engine.executor.timings.get("graph_capture_s", 0.0),
            ),
        ]
    if args.peer == "hf":
        model_dir = engine.config.model
        random_weights = engine.config.load_format == "random"
        engine.shutdown()
        del llm, engine
        peer_tok_s = hf_decode_tokens_per_s(model_dir, random_weights, prompt, args.output_len)
        result["hf_decode_tokens_per_s"] = peer_tok_s
        rows += [
            ("hf decode tokens/s", peer_tok_s),
            ("tokenloom / hf", tok_s / peer_tok_s),
        ]
    print_table(f"latency: {args.model}", rows)
    write_json(args.out, "bench-latency.json", result)
    return 0
