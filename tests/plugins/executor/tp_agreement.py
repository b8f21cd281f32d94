"""The rule by which TP=N's greedy tokens must agree with TP=1's, and the helpers
that run a model both ways (used by the CPU and the GPU tensor-parallel tests).

fp32: the tokens are identical, exactly.

bf16: TP=N's row-parallel layers round each rank's partial sum to bf16 and add the
shards in another order than TP=1's single GEMM, so the logits may differ by a bf16
rounding step; a random tiny model's greedy choice between two logits that close is
then legitimately either token. The rule, per sequence (``agree``):

1. up to the first position where the tokens differ, the logprob of every (shared)
   token differs by at most ``BF16_TOLERANCE_NATS`` between the two runs;
2. at that first divergence each run's choice is a near-top token of the other run:
   among the other's top ``TOP_K`` logprobs, and at most ``BF16_TOLERANCE_NATS`` below
   the other's best (a near-tie; with three or more tied logits the two runs may pick
   any two of them, seen on the H200); after it the contexts differ, so nothing more
   is compared.

Why 0.125 nats: the logits are bf16 (``compute_logits`` casts the head's bf16 output);
bf16 keeps 8 significant bits, so at the tiny models' logit magnitudes (8..16, measured:
the TP=1 top-2 margins are multiples of 0.0625) neighbouring logits are 0.0625 apart.
A changed rounding of the partial sums moves a logit by about one such step (measured
on the CPU: at most 0.060 nats of logprob difference over 96 shared positions), so two
logits may trade places when their margin is up to two steps, 0.125 nats. A wrong shard
is far outside it: with the two ranks' KV heads swapped the first token's logprob moves
by about a nat and the first tokens differ (``test_tp.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BF16_TOLERANCE_NATS = 0.125
TOP_K = 5

# One greedy run of one prompt: its tokens, and per token {token id: logprob} holding at
# least the top ``TOP_K`` (SamplingParams.logprobs).
Run = tuple[list[int], list[dict[int, float]]]


def generate(
    model_dir: Path | str, prompts: list[list[int]], max_tokens: int, **engine
) -> list[Run]:
    """Greedy tokens with their top-``TOP_K`` logprobs, from an engine started with ``engine``."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=TOP_K
    )
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    runs: list[Run] = []
    for out in outs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        runs.append((list(completion.token_ids), [dict(e) for e in completion.logprobs]))
    return runs


def _top(entry: dict[int, float], k: int = 2) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def _near_top(entry: dict[int, float], token: int, tol: float) -> bool:
    """``token`` is among the entry's logprobs and within ``tol`` of its best."""
    return token in entry and entry[token] >= max(entry.values()) - tol


def agree(single: Sequence[Run], parallel: Sequence[Run], dtype: str) -> float:
    """Assert the rule above (``dtype`` "float32": identical tokens); return the largest
    logprob difference over the shared positions, for the test's report."""
    if dtype == "float32":
        assert [s[0] for s in single] == [p[0] for p in parallel]
        return 0.0
    tol = BF16_TOLERANCE_NATS
    worst = 0.0
    for i, ((tokens_a, lps_a), (tokens_b, lps_b)) in enumerate(zip(single, parallel, strict=True)):
        assert len(tokens_a) == len(tokens_b), f"sequence {i}: lengths differ"
        for pos, (ta, tb) in enumerate(zip(tokens_a, tokens_b, strict=True)):
            if ta == tb:
                diff = abs(lps_a[pos][ta] - lps_b[pos][tb])
                worst = max(worst, diff)
                assert diff <= tol, (
                    f"sequence {i} position {pos}: token {ta} has logprob {lps_a[pos][ta]:.4f} "
                    f"at TP=1 and {lps_b[pos][tb]:.4f} at TP=N (more than {tol} apart)"
                )
                continue
            near = _near_top(lps_a[pos], tb, tol) and _near_top(lps_b[pos], ta, tol)
            assert near, (
                f"sequence {i} diverges at position {pos} ({ta} at TP=1, {tb} at TP=N) "
                f"and that is not a near-tie: TP=1 top {_top(lps_a[pos], 3)}, TP=N top "
                f"{_top(lps_b[pos], 3)}; each choice must be within {tol} nats of the other "
                "run's best"
            )
            break
    return worst
