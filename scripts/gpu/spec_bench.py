"""Speculative decoding on one GPU (issue 11): speed at a controlled acceptance rate.

One process, three engines on the same target (random weights of a real shape):
1. ``baseline``: no speculation (async scheduling and CUDA graphs as by default):
   decode tokens/s at each batch size, and the median decode step.
2. ``replay``: ``contrib`` replay proposer, k up to max(ks). A first pass of every
   batch records the greedy outputs (no recording yet, so no drafts: the same
   engine's figures without speculation, async scheduling off), then each (acceptance,
   k) pass replays them, with per-request k. Per pass: decode tokens/s, speedup over
   the baseline, measured acceptance and tokens per verify step, the median verify
   step (single stream), and the analytic speedup E[tokens/step] x t_decode /
   t_verify from the measured figures.
3. ``draft``: the draft proposer with ``--draft``'s shape: the draft's time per
   proposed token as % of a target decode step.

Writes spec_bench.json into ``--out`` after every phase (a partial run keeps what it
measured). CPU smoke test: ``--model DIR --draft DIR --device cpu`` with tiny models.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any


def build(args: argparse.Namespace, **options: Any) -> Any:
    from tokenloom import LLM
    from tokenloom.bench.common import _shape_or_dir

    model = _shape_or_dir(args.model)
    extra: dict[str, Any] = {}
    if model != args.model:
        extra["load_format"] = "random"
    return LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.batches),
        max_model_len=args.prompt_len + args.output_len + 64,
        seed=0,
        **extra,
        **options,
    )


def free(llm: Any) -> None:
    import torch

    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    top = min(vocab, 32000) - 20
    return [[(7 * i + 13 * b + 11) % top + 10 for i in range(length)] for b in range(batch)]


def timed_run(llm: Any, prompts: list[list[int]], output_len: int, k: int | None) -> dict:
    """Greedy, EOS ignored; per engine step: wall time and whether it verified drafts."""
    import torch

    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, num_speculative_tokens=k
    )
    before = engine.stats()
    replays_before = verify_graph_replays(engine)
    for index, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"b{time.monotonic_ns()}-{index}", prompt, params))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    tokens = 0
    first_all = None
    have_first: set[str] = set()
    steps: list[tuple[float, bool]] = []
    while engine.has_unfinished():
        verify_before = engine.scheduler.spec_verify_steps
        t0 = time.perf_counter()
        deltas = engine.step()
        steps.append((time.perf_counter() - t0, engine.scheduler.spec_verify_steps > verify_before))
        for delta in deltas:
            tokens += len(delta.new_token_ids)
            if delta.new_token_ids:
                have_first.add(delta.request_id)
        if first_all is None and len(have_first) == len(prompts):
            first_all = time.perf_counter()
    if engine.executor.spec is not None:
        engine.step()  # hands the finished ids to the executor (replay records them)
    elapsed = time.perf_counter() - started
    decode_s = time.perf_counter() - (first_all or started)
    after = engine.stats()
    from tokenloom.bench.common import spec_summary

    verify = [t for t, v in steps if v]
    plain = [t for t, v in steps[2:] if not v]
    return {
        "batch": len(prompts),
        "k": k,
        "seconds": elapsed,
        "output_tokens": tokens,
        "decode_tokens_per_s": (tokens - len(prompts)) / max(decode_s, 1e-9),
        "median_verify_step_ms": statistics.median(verify) * 1e3 if verify else None,
        "median_plain_step_ms": statistics.median(plain) * 1e3 if plain else None,
        "speculative": spec_summary(before, after),
        # engine steps whose verify forward replayed a verify CUDA graph (issue 11)
        "verify_graph_replays": verify_graph_replays(engine) - replays_before,
    }


def verify_graph_replays(engine: Any) -> int:
    """Verify steps replayed from CUDA graphs so far (0 without them)."""
    graphs = getattr(engine.executor, "verify_graphs", None) or {}
    return sum(v.replays for v in graphs.values())


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E[tokens per verify step] when each draft is right with probability ``acceptance``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument(
        "--draft", default="llama-3.2-1b", help="shape or dir; none: no draft phase"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--ks", default="2,4,6")
    # 0.5: about the per-token acceptance of ngram on SmolLM2-135M editing code (k=2: 0.88
    # accepted per verify step = a + a^2, a = 0.55; k=4: 1.29, a = 0.47; docs/speculative.md).
    parser.add_argument("--acceptances", default="0.5,0.6,0.8,0.9")
    parser.add_argument("--batch-acceptances", default="0.6,0.8,0.9")
    parser.add_argument("--batch-grid", default="2,4", help="ks run at batch > 1")
    parser.add_argument("--draft-k", type=int, default=4)
    parser.add_argument(
        "--max-verify-graph-seqs",
        type=int,
        default=None,
        help="the replay engine's verify-graph limit (default: the engine's, 64); batch 128 "
        "verifies eagerly under it",
    )
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    batch_ks = [int(k) for k in args.batch_grid.split(",")]
    acceptances = [float(a) for a in args.acceptances.split(",")]
    batch_acceptances = [float(a) for a in args.batch_acceptances.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": args.model, "draft": args.draft, "dtype": args.dtype,
                              "prompt_len": args.prompt_len, "output_len": args.output_len}  # fmt: skip

    def save() -> None:
        (out / "spec_bench.json").write_text(json.dumps(result, indent=2))

    # 1. baseline
    llm = build(args)
    vocab = llm.engine.info.vocab_size
    timed_run(llm, prompts_for(1, args.prompt_len, vocab), 32, None)  # warm-up
    result["baseline"] = {
        b: timed_run(llm, prompts_for(b, args.prompt_len, vocab), args.output_len, None)
        for b in args.batches
    }
    save()
    free(llm)
    base_step = result["baseline"][1]["median_plain_step_ms"] if 1 in args.batches else None

    # 2. replay at controlled acceptance
    graphs = {}
    if args.max_verify_graph_seqs is not None:
        graphs["max_verify_graph_seqs"] = args.max_verify_graph_seqs
    result["max_verify_graph_seqs"] = args.max_verify_graph_seqs
    llm = build(args, proposer="replay", num_speculative_tokens=max(ks + batch_ks), **graphs)
    proposer = llm.engine.executor.spec.proposer
    recorded = {}
    for b in args.batches:
        # k = 1 with nothing recorded yet: no drafts, but the proposer sees (and records)
        # the requests; the figures are the speculative engine's plain decode.
        recorded[b] = timed_run(llm, prompts_for(b, args.prompt_len, vocab), args.output_len, 1)
    result["replay_recording_pass"] = recorded
    runs = []
    for b in args.batches:
        for acceptance in acceptances if b == 1 else batch_acceptances:
            for k in ks if b == 1 else batch_ks:
                proposer.acceptance = acceptance
                run = timed_run(llm, prompts_for(b, args.prompt_len, vocab), args.output_len, k)
                run["acceptance"] = acceptance
                base = result["baseline"][b]["decode_tokens_per_s"]
                run["speedup"] = run["decode_tokens_per_s"] / base
                spec = run["speculative"] or {}
                if b == 1 and base_step and run["median_verify_step_ms"]:
                    run["verify_over_decode_step"] = run["median_verify_step_ms"] / base_step
                    run["analytic_speedup"] = (
                        spec.get("mean_accepted_length", 1.0) / run["verify_over_decode_step"]
                    )
                    run["analytic_speedup_from_acceptance"] = (
                        expected_tokens_per_step(acceptance, k) / run["verify_over_decode_step"]
                    )
                runs.append(run)
                print(json.dumps({key: run.get(key) for key in (
                    "batch", "k", "acceptance", "decode_tokens_per_s", "speedup",
                    "verify_over_decode_step", "analytic_speedup", "verify_graph_replays")}),
                    flush=True)  # fmt: skip
                result["replay"] = runs
                save()
    free(llm)

    # 3. draft model cost (``--draft none``: skipped)
    if args.draft == "none":
        return
    from tokenloom.bench.common import _shape_or_dir

    llm = build(
        args,
        proposer="draft",
        num_speculative_tokens=args.draft_k,
        draft_model=_shape_or_dir(args.draft),
    )
    proposer = llm.engine.executor.spec.proposer
    calls: list[tuple[float, int]] = []
    propose = proposer.propose

    def timed_propose(ids, histories, counts):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        drafts = propose(ids, histories, counts)  # ends with a host read: synchronous
        calls.append((time.perf_counter() - t0, sum(len(d) for d in drafts)))
        return drafts

    proposer.propose = timed_propose
    draft: dict[str, Any] = {}
    for b in [b for b in args.batches if b <= 32]:
        calls.clear()
        run = timed_run(llm, prompts_for(b, args.prompt_len, vocab), args.output_len // 2, None)
        times = [t for t, n in calls[2:] if n]
        per_call = statistics.median(times) if times else None
        run["draft_ms_per_propose"] = per_call * 1e3 if per_call else None
        if per_call and b in result["baseline"]:
            step = result["baseline"][b]["median_plain_step_ms"]
            run["draft_ms_per_token"] = per_call * 1e3 / args.draft_k
            run["draft_token_over_target_step_percent"] = (
                100 * run["draft_ms_per_token"] / step if step else None
            )
        draft[b] = run
        print(json.dumps({"draft_batch": b, **{k: run.get(k) for k in (
            "draft_ms_per_token", "draft_token_over_target_step_percent")}}), flush=True)  # fmt: skip
    result["draft"] = draft
    save()
    free(llm)
    print(f"wrote {out / 'spec_bench.json'}")


if __name__ == "__main__":
    main()
