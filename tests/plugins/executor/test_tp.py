"""Tensor parallelism on the CPU (gloo): TP=N gives TP=1's greedy tokens (and
transformers'), for every architecture, with GQA, MQA (KV heads replicated) and a
vocabulary that does not split evenly; a dead worker fails the generation within 5 s
and leaves no process behind.

Each engine here starts real worker processes (fresh interpreters importing torch:
a few seconds each on a small CPU), so the models and generations stay tiny.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.executor.parallel.workers import WorkerDiedError

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 33, 17, 8], [40, 41, 42] * 5, list(range(100, 131))]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small pool and budget: prompts are prefilled in chunks, decodes batch with prefills.
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_blocks=96, max_num_batched_tokens=16)
ODD_VOCAB = 3  # added to the default (a multiple of 64): splits over neither 2 nor 4 ranks


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _generate(model_dir, **options) -> list[list[int]]:
    llm = LLM(str(model_dir), **ENGINE, **options)
    try:
        return _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()


def _hf_greedy(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        results.append(out[0, len(prompt) :].tolist())
    return results


def _default_vocab(tiny_model_factory) -> int:
    import json

    config = json.loads((tiny_model_factory("llama") / "config.json").read_text())
    return int(config["vocab_size"])


# (arch, tensor_parallel_size, checkpoint options, engine options)
CASES = {
    "llama-tp2-gqa-async": ("llama", 2, {}, {"async_scheduling": True}),
    "mistral-tp2": ("mistral", 2, {}, {}),
    "qwen2-tp2-tied": ("qwen2", 2, {"tie_word_embeddings": True}, {}),
    # the symmetric-memory option parses and is a no-op on gloo
    "qwen3-tp2-qk-norm": ("qwen3", 2, {}, {"plugin": {"model": {"symm_mem_all_reduce": True}}}),
    "llama3-tp4-4kv-odd-vocab": ("llama3", 4, {"num_kv_heads": 4, "vocab": ODD_VOCAB}, {}),
    "qwen2-tp2-mqa-odd-vocab": ("qwen2", 2, {"num_kv_heads": 1, "vocab": ODD_VOCAB}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_at_tp_equal_tp1_and_transformers(tiny_model_factory, case):
    arch, size, options, engine = CASES[case]
    options = dict(options)
    if "vocab" in options:
        options["vocab_size"] = _default_vocab(tiny_model_factory) + options.pop("vocab")
    model_dir = tiny_model_factory(arch, **options)

    single = _generate(model_dir, **engine)
    parallel = _generate(model_dir, tensor_parallel_size=size, **engine)

    assert parallel == single
    assert single == _hf_greedy(model_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_killed_worker_fails_generation_within_5s_and_leaves_no_process(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_kv_heads=4)
    llm = LLM(str(model_dir), **ENGINE, tensor_parallel_size=4)
    pool = llm.engine.executor.pool  # type: ignore[attr-defined]
    pids = list(pool.pids)
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    killed_at: list[float] = []

    def kill_rank_2() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pids[1], 9)

    killer = threading.Thread(target=kill_rank_2)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"worker rank 2 \(pid \d+\) killed by signal 9"):
            llm.generate(PROMPTS, long, use_tqdm=False)
        failed_after = time.monotonic() - killed_at[0]
        assert failed_after < 5.0
        # The group is down: the other workers are gone too, and later steps fail at once.
        deadline = time.monotonic() + 5.0
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        with pytest.raises(WorkerDiedError):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        killer.join()
        llm.shutdown()
    assert not any(_alive(p) for p in pids)


def test_shutdown_stops_every_worker(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), **ENGINE, tensor_parallel_size=2)
    pids = list(llm.engine.executor.pool.pids)  # type: ignore[attr-defined]
    assert _tokens(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False))[0]
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < 5.0
    assert not any(_alive(p) for p in pids)


def test_worker_dead_at_start_fails_the_start_at_once(tiny_model_factory, monkeypatch):
    from tokenloom.plugins.executor.parallel.workers import WorkerPool

    start = WorkerPool.start

    def start_then_kill(pool: WorkerPool) -> None:
        start(pool)
        pool.procs[0].kill()

    monkeypatch.setattr(WorkerPool, "start", start_then_kill)
    began = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 .* killed by signal 9"):
        LLM(str(tiny_model_factory("llama")), **ENGINE, tensor_parallel_size=2)
    assert time.monotonic() - began < 10.0  # not the 600 s start timeout


def test_size_that_does_not_divide_the_heads_is_refused_with_the_reason(tiny_model_factory):
    with pytest.raises(ValueError, match="tensor_parallel_size must divide the number of"):
        LLM(str(tiny_model_factory("llama")), **ENGINE, tensor_parallel_size=3)


# --- the bf16 agreement rule (tp_agreement.py): passes TP=2, fails a wrong shard ---

BF16_PROMPTS = [[5, 9, 2, 33, 17], [40, 41, 42] * 7, [7]]


def _swap_kv_head_halves(model_dir, out_dir):
    """A copy of ``model_dir`` whose k/v projections hold their KV heads' two halves
    swapped: TP=2 on it computes exactly what TP=2 would on the original if the loader
    gave rank 0 rank 1's KV heads and rank 1 rank 0's."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            half = tensor.shape[0] // 2
            tensors[name] = torch.cat([tensor[half:], tensor[:half]]).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def test_bf16_rule_passes_tp2_and_fails_a_shard_with_swapped_kv_heads(tiny_model_factory, tmp_path):
    from tp_agreement import BF16_TOLERANCE_NATS, agree, generate

    model = tiny_model_factory("llama", num_heads=8, num_kv_heads=2, hidden_size=256)
    engine = dict(device="cpu", dtype="bfloat16", num_blocks=64, max_model_len=256)
    single = generate(model, BF16_PROMPTS, 16, **engine)
    parallel = generate(model, BF16_PROMPTS, 16, tensor_parallel_size=2, **engine)
    assert agree(single, parallel, "bfloat16") <= BF16_TOLERANCE_NATS

    wrong = _swap_kv_head_halves(model, tmp_path / "swapped")
    swapped = generate(wrong, BF16_PROMPTS, 16, tensor_parallel_size=2, **engine)
    with pytest.raises(AssertionError, match="not a near-tie|more than 0.125 apart"):
        agree(single, swapped, "bfloat16")
    # and by far, from the first token of every prompt: TP=1's first token leaves the
    # swapped run's top two, or its logprob moves by more than four tolerances
    for (tokens, lps), (_, lps_swapped) in zip(single, swapped, strict=True):
        first = tokens[0]
        moved = abs(lps[0][first] - lps_swapped[0].get(first, float("-inf")))
        assert moved > 4 * BF16_TOLERANCE_NATS, (first, lps[0], lps_swapped[0])


def _run(tokens: list[int], top2: list[tuple[tuple[int, float], tuple[int, float]]]):
    return tokens, [dict(pair) for pair in top2]


def test_bf16_rule_on_constructed_runs():
    from tp_agreement import agree

    near = ((1, -0.50), (2, -0.55))  # 1 leads 2 by 0.05 nats
    flipped = ((2, -0.52), (1, -0.53))
    far = ((1, -0.1), (2, -2.0))
    base = _run([1, 1], [near, near])
    # identical, with logprobs a little apart
    assert agree(
        [base], [_run([1, 1], [((1, -0.45), (2, -0.5)), near])], "bfloat16"
    ) == pytest.approx(0.05)
    # divergence at a near-tie where the two swap places: allowed, rest not compared
    assert agree([base], [_run([2, 7], [flipped, far])], "bfloat16") == 0.0
    # a three-way tie (seen on the H200): TP=1 picks 532 of {611, 532, 127}, TP=N picks
    # 127 of {532, 127, 611}: each choice is within the tolerance of the other's best
    tie_a = [{611: -1.9891, 532: -1.9891, 127: -1.9892}]
    tie_b = [{532: -1.98925, 127: -1.98925, 611: -1.9893}]
    assert agree([([532], tie_a)], [([127], tie_b)], "bfloat16") == 0.0
    # divergence where TP=1 was sure: refused
    with pytest.raises(AssertionError, match="not a near-tie"):
        agree([_run([1], [far])], [_run([2], [flipped])], "bfloat16")
    # the other run's choice is not even in TP=1's top two: refused
    with pytest.raises(AssertionError, match="not a near-tie"):
        agree([base], [_run([3, 1], [((3, -0.5), (1, -0.52)), near])], "bfloat16")
    # same tokens, logprob moved by more than the tolerance: refused
    with pytest.raises(AssertionError, match="more than 0.125 apart"):
        agree([base], [_run([1, 1], [((1, -0.2), (2, -0.9)), near])], "bfloat16")
    # fp32 is exact: any token difference fails
    with pytest.raises(AssertionError):
        agree([base], [_run([2, 1], [flipped, near])], "float32")
