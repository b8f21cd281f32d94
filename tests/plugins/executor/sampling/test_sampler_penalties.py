"""Repetition (HF), presence and frequency (OpenAI) penalties, exactly as specified."""

from __future__ import annotations

import torch

from tokenloom.plugins.executor.sampling.penalties import TokenCounts, apply_penalties
from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData


def column(value: float) -> torch.Tensor:
    return torch.tensor([[value]])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.0]])
    counts = torch.tensor([[0, 1, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[True, False, False, False, False]])
    out = apply_penalties(logits, counts, prompt, column(2.0), column(0.0), column(0.0))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.0]]


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = torch.tensor([[0, 1, 3, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, False, True]])  # the prompt does not count
    out = apply_penalties(logits, counts, prompt, column(1.0), column(0.5), column(0.25))
    assert out.tolist() == [[1.0, 1.0 - 0.25 - 0.5, 1.0 - 0.75 - 0.5, 1.0]]


def test_the_sampler_penalises_from_the_prompt_and_the_recorded_history() -> None:
    vocab = 6
    sampler = Sampler(vocab, "cpu")
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    sampler.add_request(NewRequestData("p", [0], params))
    sampler.add_request(NewRequestData("plain", [0], SamplingParams(temperature=0.0)))
    sampler.count_host_tokens(["p", "plain"], [2, 2])
    # A list per request, as with speculation:
    sampler.count_host_tokens(["p", "plain"], [[2, 3], [3]])
    logits = torch.tensor([[4.0, 4.0, 4.0, -4.0, 4.0, 4.0]]).repeat(2, 1)
    out = sampler.process_logits(logits, ["plain", "p"])
    assert out[0].tolist() == logits[0].tolist()
    expected = [2.0, 4.0, 2.0 - 0.5 - 0.5, -8.0 - 0.25 - 0.5, 4.0, 4.0]
    assert out[1].tolist() == expected


def test_penalties_change_the_greedy_choice() -> None:
    sampler = Sampler(4, "cpu")
    sampler.add_request(
        NewRequestData("a", [1], SamplingParams(temperature=0.0, repetition_penalty=3.0))
    )
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]])
    assert sampler.sample(logits, ["a"]).token_ids.tolist() == [2]


def test_token_counts_grow_past_their_initial_slots_and_keep_counts() -> None:
    counts = TokenCounts(vocab_size=8, device=torch.device("cpu"), initial_slots=2)
    ids = [f"r{i}" for i in range(5)]
    for i, request_id in enumerate(ids):
        counts.add(request_id, [i])
        counts.record([request_id], [[i, i, 7]])
    for i, request_id in enumerate(ids):
        slot = counts.slot(request_id)
        assert counts.output_counts[slot, i] == 2 and counts.output_counts[slot, 7] == 1
        assert counts.prompt_mask[slot].nonzero().flatten().tolist() == [i]
    counts.remove("r0")
    counts.add("new", [])
    assert counts.output_counts[counts.slot("new")].sum() == 0
