"""The device-side sampling parameters of one batch composition.

Built on the host from the requests' ``SamplingParams`` whenever the ordered set of
sampling requests changes, then reused step after step: no per-step host work beyond
comparing the batch key. Each optional tensor is None when no row needs it, which is
how the sampler skips the corresponding work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloom.plugins.executor.staging import upload
from tokenloom.protocols.sampling import SamplingParams

MIN_TEMPERATURE = 1e-5  # below it a row samples greedily (as vLLM's _SAMPLING_EPS)


@dataclass(slots=True)
class RequestSamplingState:
    """What the sampler keeps for one request between steps."""

    params: SamplingParams
    generator: torch.Generator | None  # on the sampler's device; None when unseeded
    masked_until_min_tokens: list[int]  # EOS and stop token ids, masked while short
    num_output: int = 0  # tokens generated so far (counted for min_tokens rows only)

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )

    @property
    def needs_min_tokens_mask(self) -> bool:
        return self.params.min_tokens > 0 and bool(self.masked_until_min_tokens)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of one batch, as device tensors."""

    key: tuple[str, ...]
    all_greedy: bool
    greedy: torch.Tensor | None  # [B, 1] bool; None when no row is greedy
    temperature: torch.Tensor | None  # [B, 1] float32 (1.0 on greedy rows); None if all greedy
    top_k: torch.Tensor | None  # [B, 1] int64; None when no row filters by top-k
    top_k_off: torch.Tensor | None  # [B, 1] bool
    max_top_k: int
    all_top_k: bool  # every row keeps at most max_top_k tokens
    top_p: torch.Tensor | None  # [B, 1] float32 (2.0 = off); None when no row filters
    min_p: torch.Tensor | None  # [B, 1] float32; None when no row filters
    seeded_rows: list[tuple[int, torch.Generator]]  # sampled rows with their own generator
    penalty_rows: torch.Tensor | None  # [P] int64: rows with any penalty
    penalty_slots: torch.Tensor | None  # [P] int64: their TokenCounts slots
    repetition: torch.Tensor | None  # [P, 1] float32
    presence: torch.Tensor | None  # [P, 1] float32
    frequency: torch.Tensor | None  # [P, 1] float32
    min_tokens_rows: list[int]  # rows that may still need EOS / stop ids masked
    num_logprobs: list[int]  # per row: top logprobs asked for; -1 = no logprobs
    max_logprobs: int  # -1 when no row asked

    @property
    def needs_processing(self) -> bool:
        """False when plain argmax of the raw logits is the whole answer."""
        return not self.all_greedy or self.penalty_rows is not None or bool(self.min_tokens_rows)


def build_sampling_batch(
    key: tuple[str, ...],
    states: Sequence[RequestSamplingState],
    penalty_slots: Sequence[int | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingBatch:
    """Gather the rows' parameters into device tensors (host work, once per composition)."""
    params = [s.params for s in states]
    # A temperature this small is greedy: dividing by it overflows the logits to inf,
    # whose softmax is NaN, and the draw then returned token 0 (an empty answer).
    greedy = [p.greedy or p.temperature < MIN_TEMPERATURE for p in params]
    all_greedy = all(greedy)
    # A greedy row keeps only its argmax, like top-k 1; saying so lets a batch where every
    # sampled row has a top-k take the cheap topk path instead of a full sort.
    top_ks = [
        1 if g else (p.top_k if 0 < p.top_k < vocab_size else 0)
        for p, g in zip(params, greedy, strict=True)
    ]
    top_ps = [
        p.top_p if p.top_p < 1.0 and not g else 2.0 for p, g in zip(params, greedy, strict=True)
    ]
    min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
    use_top_k = any(k and not g for k, g in zip(top_ks, greedy, strict=True))
    all_top_k = use_top_k and all(top_ks)
    use_top_p = any(p <= 1.0 for p in top_ps)
    max_top_k = max(top_ks)

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=dtype).view(-1, 1), device)

    top_k: torch.Tensor | None = None
    top_k_off: torch.Tensor | None = None
    if use_top_k:
        # With top-p, rows rank over the sorted candidates (the whole vocab unless every
        # row has a top-k); without, over the max_top_k largest.
        off_value = vocab_size if use_top_p and not all_top_k else max_top_k
        top_k = column([k or off_value for k in top_ks], torch.int64)
        top_k_off = column([k == 0 for k in top_ks], torch.bool)

    rows = [i for i, s in enumerate(states) if s.has_penalties]
    penalty = [params[i] for i in rows]
    with_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        key=key,
        all_greedy=all_greedy,
        greedy=column(greedy, torch.bool) if any(greedy) else None,
        temperature=None
        if all_greedy
        else column(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
            torch.float32,
        ),
        top_k=top_k,
        top_k_off=top_k_off,
        max_top_k=max_top_k,
        all_top_k=all_top_k,
        top_p=column(top_ps, torch.float32) if use_top_p else None,
        min_p=column(min_ps, torch.float32) if any(min_ps) else None,
        seeded_rows=[
            (i, s.generator)
            for i, (s, g) in enumerate(zip(states, greedy, strict=True))
            if s.generator is not None and not g
        ],
        penalty_rows=_ids(rows, device) if rows else None,
        penalty_slots=_ids([penalty_slots[i] or 0 for i in rows], device) if rows else None,
        repetition=column([p.repetition_penalty for p in penalty], torch.float32) if rows else None,
        presence=column([p.presence_penalty for p in penalty], torch.float32) if rows else None,
        frequency=column([p.frequency_penalty for p in penalty], torch.float32) if rows else None,
        min_tokens_rows=[i for i, s in enumerate(states) if s.needs_min_tokens_mask],
        num_logprobs=[-1 if p.logprobs is None else p.logprobs for p in params],
        max_logprobs=max(with_logprobs) if with_logprobs else -1,
    )


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=torch.int64), device)
