"""A temperature near 0 samples the argmax, as greedy does (issue 15: 1e-38 gave NaN\nprobabilities and an empty answer)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-9])
def test_a_tiny_temperature_takes_the_argmax_like_greedy(temperature) -> None:
    logits = torch.randn(4, 32) * 10
    sampler = Sampler(32, "cpu")
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        t = temperature if i % 2 == 0 else 1.0
        sampler.add_request(NewRequestData(rid, [1, 2, 3], SamplingParams(temperature=t, seed=i)))
    tokens = sampler.sample(logits, ids).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
