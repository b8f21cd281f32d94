"""Perplexity of a fixed text, from the engine's own prompt logprobs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenloom.protocols.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from tokenloom.llm import LLM


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float  # exp(nll_sum / num_tokens)
    nll_sum: float  # minus the sum of the predicted tokens' logprobs
    num_tokens: int  # predicted tokens: each passage's tokens after its first
    num_passages: int
    seconds: float
    passage_nlls: list[float] = field(default_factory=list)  # each passage's nll_sum
    passage_tokens: list[int] = field(default_factory=list)  # each passage's predicted tokens


def load_passages(path: str | Path) -> list[str]:
    """The text's passages: its paragraphs (blocks separated by blank lines)."""
    text = Path(path).read_text(encoding="utf-8")
    return [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]


def measure_perplexity(llm: LLM, passages: list[str]) -> PerplexityResult:
    """Run every passage as one prompt with ``prompt_logprobs``; one batch, one token
    generated each (its value is ignored)."""
    started = time.perf_counter()
    prompts = [llm.tokenizer.encode(p) for p in passages]
    for i, ids in enumerate(prompts):
        if len(ids) < 2 or len(ids) >= llm.max_model_len:
            raise ValueError(
                f"passage {i}: {len(ids)} tokens; perplexity needs 2 to "
                f"{llm.max_model_len - 1} (max_model_len)"
            )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nlls, counts = [], []
    for ids, out in zip(prompts, outputs, strict=True):
        values = out.prompt_logprobs
        if values is None or len(values) != len(ids) - 1:
            raise RuntimeError(
                f"request {out.request_id}: expected {len(ids) - 1} prompt logprobs, got "
                f"{None if values is None else len(values)}"
            )
        nlls.append(-math.fsum(values))
        counts.append(len(values))
    nll_sum, num_tokens = math.fsum(nlls), sum(counts)
    return PerplexityResult(
        perplexity=math.exp(nll_sum / num_tokens),
        nll_sum=nll_sum,
        num_tokens=num_tokens,
        num_passages=len(passages),
        seconds=time.perf_counter() - started,
        passage_nlls=nlls,
        passage_tokens=counts,
    )


def bootstrap_log_ratios(
    nlls: list[float], ref_nlls: list[float], tokens: list[int], samples: int, seed: int = 0
) -> torch.Tensor:
    """``log(perplexity / reference perplexity)`` over ``samples`` resamples of the
    passages, drawn with replacement, the same draw for both models (paired). A passage
    is the unit because its tokens are not independent of one another."""
    import torch

    if not len(nlls) == len(ref_nlls) == len(tokens) or not tokens:
        raise ValueError("one summed nll and one token count per passage, for both models")
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(tokens), (samples, len(tokens)), generator=gen)
    diff = torch.tensor(nlls, dtype=torch.float64) - torch.tensor(ref_nlls, dtype=torch.float64)
    return diff[draws].sum(1) / torch.tensor(tokens, dtype=torch.float64)[draws].sum(1)


def interval_pct(log_ratios: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of the resampled ratios, as percent changes."""
    import torch

    tail = (1.0 - level) / 2
    q = torch.tensor([tail, 1.0 - tail], dtype=torch.float64)
    lo, hi = torch.quantile(log_ratios, q).tolist()
    return 100 * math.expm1(lo), 100 * math.expm1(hi)
