"""Perplexity of a fixed text, from the engine's own prompt logprobs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenloom.protocols.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenloom.llm import LLM


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float  # exp(nll_sum / num_tokens)
    nll_sum: float  # minus the sum of the predicted tokens' logprobs
    num_tokens: int  # predicted tokens: each passage's tokens after its first
    num_passages: int
    seconds: float


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
    nll_sum, num_tokens = 0.0, 0
    for ids, out in zip(prompts, outputs, strict=True):
        values = out.prompt_logprobs
        if values is None or len(values) != len(ids) - 1:
            raise RuntimeError(
                f"request {out.request_id}: expected {len(ids) - 1} prompt logprobs, got "
                f"{None if values is None else len(values)}"
            )
        nll_sum -= math.fsum(values)
        num_tokens += len(values)
    return PerplexityResult(
        perplexity=math.exp(nll_sum / num_tokens),
        nll_sum=nll_sum,
        num_tokens=num_tokens,
        num_passages=len(passages),
        seconds=time.perf_counter() - started,
    )
