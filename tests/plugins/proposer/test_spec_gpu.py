"""GPU: speculative decoding keeps greedy tokens identical with CUDA graphs and Triton.

The reference runs without speculation (CUDA graphs for decode steps, async
scheduling on); the speculative runs verify on the Triton extend path (in verify
graphs when every request has 1 + k tokens, else eager) and decode their
non-speculating steps in graphs. fp32: tokens must be identical (bf16 near-ties may
flip an argmax between the decode and extend kernels; see
``tests/plugins/executor/test_gpu_modes.py``, whose rule the bf16 case uses).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 2, 33, 17] * 4, [40, 41, 42] * 7, list(range(100, 180)), [7, 8, 7, 8, 7]]


def _generate(model_dir, **options):
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cuda", dtype="float32", attention="triton", **options)
    assert llm.engine.executor.graphs is not None, "CUDA graphs were not captured"
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1),
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    stats = llm.engine.stats()
    llm.engine.shutdown()
    return outs, stats


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-small"])
def test_speculative_greedy_tokens_equal_the_graph_decode(tiny_model_factory, proposer):
    model = tiny_model_factory("llama", num_heads=8, num_kv_heads=2, hidden_size=256)
    reference, _ = _generate(model)
    options: dict = {"proposer": proposer.split("-")[0], "num_speculative_tokens": 4}
    if proposer == "draft-self":
        options["draft_model"] = str(model)
    elif proposer == "draft-small":
        options["draft_model"] = str(
            tiny_model_factory("llama", num_heads=4, num_kv_heads=2, hidden_size=64, seed=5)
        )
    spec, stats = _generate(model, **options)
    assert spec == reference
    assert stats.spec_verify_steps_total > 0
    if proposer == "draft-self":
        assert stats.spec_accepted_tokens_total >= 0.95 * stats.spec_draft_tokens_total


# Ten prompts, so the bf16 rule (>= 90 % identical) allows one near-tie divergence.
VERIFY_PROMPTS = PROMPTS + [[3 + i, 60 + 2 * i, 9, 9, 200 + i] * (i + 1) for i in range(6)]
GREEDY_ALL = [
    dict(max_tokens=48),
    dict(max_tokens=40),  # leaves early: later steps run in smaller, padded buckets
    dict(max_tokens=29),
    dict(max_tokens=48, logprobs=1),
] + [dict(max_tokens=20 + 4 * i) for i in range(6)]


def _run(model_dir, dtype, **options):
    """Greedy tokens of VERIFY_PROMPTS (every request speculates when the engine does), the
    verify graphs' replays by tokens per request (1 + k; None: none built) and the
    number of steps whose every request had 1 + k tokens, k = 1 .. 4, by 1 + k (the
    steps verify graphs should replay)."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cuda", dtype=dtype, attention="triton", **options)
    runner = llm.engine.executor
    assert runner.graphs is not None, "decode CUDA graphs were not captured"
    shapes: list[tuple[int, int, int]] = []
    forward = runner._forward

    def recording_forward(batch):  # type: ignore[no-untyped-def]
        shapes.append((batch.num_seqs, batch.num_tokens, batch.meta.max_query_len))
        return forward(batch)

    runner._forward = recording_forward
    params = [SamplingParams(temperature=0.0, ignore_eos=True, **p) for p in GREEDY_ALL]
    results = llm.generate(VERIFY_PROMPTS, params, use_tqdm=False)
    outs = [o.outputs[0].token_ids for o in results]
    for verify in runner.verify_graphs.values():  # one per k in 1 .. num_speculative_tokens
        assert sorted(verify.graphs) == verify.sizes, "verify graphs were not captured"
    replays = {w: v.replays for w, v in runner.verify_graphs.items()} or None
    uniform = {w: sum(q == w and t == w * n for n, t, q in shapes) for w in range(2, 6)}
    llm.engine.shutdown()
    return outs, replays, uniform


def _agree(a, b, dtype):
    """tests/plugins/executor/test_gpu_modes.py's rule: fp32 identical; bf16 every
    prompt's first token and >= 90 % of the prompts identical."""
    if dtype == "float32":
        assert a == b
        return
    assert all(x[0] == y[0] for x, y in zip(a, b, strict=True))
    same = sum(x == y for x, y in zip(a, b, strict=True))
    assert same >= 0.9 * len(a), (a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_graphs_give_the_eager_verify_and_plain_greedy_tokens(
    tiny_model_factory, tmp_path, dtype
):
    """Verify steps replayed from CUDA graphs == verify steps run eagerly
    (max_verify_graph_seqs = 0) == no speculation; the graphs were replayed. The
    replay proposer drafts k = 4 tokens from the plain run, 70 % right: accepts and
    rejections (rejected slots rewritten next step), uniform 1 + k batches."""
    model = tiny_model_factory("llama", num_heads=8, num_kv_heads=2, hidden_size=256)
    plain, replays, _ = _run(model, dtype)
    assert replays is None  # no speculation: no verify graphs
    recorded = tmp_path / "plain.jsonl"
    recorded.write_text(
        "".join(
            json.dumps({"prompt": p, "output": o}) + "\n"
            for p, o in zip(VERIFY_PROMPTS, plain, strict=True)
        )
    )
    spec = {
        "proposer": "replay",
        "num_speculative_tokens": 4,
        "plugin": {"replay": {"acceptance": 0.7, "path": str(recorded)}},
    }
    eager, eager_replays, eager_uniform = _run(model, dtype, max_verify_graph_seqs=0, **spec)
    graphs, graph_replays, graph_uniform = _run(model, dtype, **spec)
    assert eager_replays is None and eager_uniform[5] > 0
    assert graph_replays == graph_uniform  # every uniform 1 + k step replayed a graph
    assert graph_replays[5] > 0
    _agree(plain, eager, dtype)
    _agree(plain, graphs, dtype)
    _agree(eager, graphs, dtype)
