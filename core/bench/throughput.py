"""``tokenloom bench throughput``: offline throughput on a fixed random workload.

256 requests (by default) with input and output lengths uniform in 100..1024,
random token ids, EOS ignored, fixed seed. ``--peer hf`` runs Hugging Face
transformers ``generate`` on the same model, device and workload in the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenloom.bench.common import (
    add_engine_args,
    engine_options,
    print_table,
    spec_summary,
    write_json,
)
from tokenloom.sim.workload import make_workload


def run_tokenloom(llm: Any, passes: list[list[tuple[list[int], int]]]) -> dict[str, Any]:
    """Time one pass per workload in ``passes`` (after a short warm-up); the figures
    are the pass of median output tokens/s, every pass listed under ``passes``. Each pass has
    its own prompts: a repeated prompt would be served from the prefix cache."""
    from tokenloom import SamplingParams

    warm = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.generate([ids[:64] for ids, _ in passes[0][:4]], warm, use_tqdm=False)
    results = []
    for work in passes:
        prompts = [ids for ids, _ in work]
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for _, n in work]
        _sync()
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        elapsed = time.perf_counter() - started
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert out_tokens == sum(n for _, n in work), "every request must produce max_tokens"
        in_tokens = sum(len(p) for p in prompts)
        results.append((elapsed, in_tokens, out_tokens))
    by_rate = sorted(results, key=lambda r: r[2] / r[0])
    elapsed, in_tokens, out_tokens = by_rate[len(results) // 2]
    return {
        "seconds": elapsed,
        "requests_per_s": len(passes[0]) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "passes": [
            {"seconds": t, "output_tokens_per_s": o / t, "total_tokens_per_s": (i + o) / t}
            for t, i, o in results
        ],
    }


def hf_model(model_dir: str, random_weights: bool) -> tuple[Any, str]:
    """The transformers model of ``model_dir`` in eval mode: bf16 on CUDA, fp32 on the CPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if random_weights:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
        # PreTrainedModel.to is wrapped by functools.wraps, whose typeshed stub is not a
        # descriptor: mypy sees an unbound method and takes `device` for `self`.
        model = model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model, device


def run_hf(model_dir: str, random_weights: bool, work: list[tuple[list[int], int]], batch: int):
    """transformers generate, batched with left padding; counts only requested tokens."""
    import torch

    model, device = hf_model(model_dir, random_weights)
    pad = 0
    _sync()
    started = time.perf_counter()
    out_tokens = 0
    ordered = sorted(work, key=lambda w: len(w[0]))
    for start in range(0, len(ordered), batch):
        group = ordered[start : start + batch]
        width = max(len(ids) for ids, _ in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(n for _, n in group)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=pad,
            )
        out_tokens += sum(n for _, n in group)
    _sync()
    elapsed = time.perf_counter() - started
    del model
    return {"seconds": elapsed, "output_tokens_per_s": out_tokens / elapsed}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom bench throughput", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--peer", choices=["none", "hf"], default="none")
    parser.add_argument("--peer-batch-size", type=int, default=256)
    parser.add_argument("--peer-num-prompts", type=int, default=None)
    args = parser.parse_args(argv)

    from tokenloom import LLM

    options = engine_options(args)
    llm = LLM(**options)
    vocab = llm.engine.info.vocab_size
    # Pass i draws its own prompts (seed + i): same distribution, no prefix-cache hits.
    passes = [
        make_workload(args.num_prompts, args.min_len, args.max_len, vocab, args.seed + i)
        for i in range(args.runs)
    ]
    work = passes[0]
    before = llm.engine.stats()
    ours = run_tokenloom(llm, passes)
    spec = spec_summary(before, llm.engine.stats())
    result: dict[str, Any] = {
        "model": args.model,
        "config": {k: v for k, v in options.items() if k != "model"},
        "num_prompts": args.num_prompts,
        "tokenloom": ours,
        "memory_gib": dict(llm.engine.executor.memory),
        "startup_s": dict(llm.engine.executor.timings),
    }
    if spec is not None:
        result["speculative"] = spec
    rows = [
        (
            "passes: output tokens/s",
            ", ".join(f"{p['output_tokens_per_s']:,.0f}" for p in ours["passes"]),
        ),
        ("requests/s", ours["requests_per_s"]),
        ("output tokens/s", ours["output_tokens_per_s"]),
        ("total tokens/s", ours["total_tokens_per_s"]),
        ("seconds", ours["seconds"]),
    ]
    if args.peer == "hf":
        model_dir = llm.engine.config.model
        random_weights = llm.engine.config.load_format == "random"
        llm.engine.shutdown()
        del llm
        peer_work = work[: args.peer_num_prompts] if args.peer_num_prompts else work
        peer = run_hf(model_dir, random_weights, peer_work, args.peer_batch_size)
        result["hf"] = peer
        result["ratio_output_tokens_per_s"] = (
            ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        )
        rows += [
            ("hf output tokens/s", peer["output_tokens_per_s"]),
            ("tokenloom / hf", result["ratio_output_tokens_per_s"]),
        ]
    print_table(f"throughput: {args.model}", rows)
    write_json(args.out, "bench-throughput.json", result)
    return 0
