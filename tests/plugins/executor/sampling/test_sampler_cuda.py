"""The sampler on a GPU: no host sync while sampling, seeds independent of the batch."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

pytestmark = pytest.mark.gpu

VOCAB = 4096

EVERY_FEATURE = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy-penalised": SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11),
    "min-p": SamplingParams(temperature=1.2, min_p=0.05, presence_penalty=0.5),
    "min-tokens": SamplingParams(temperature=0.7, min_tokens=4, frequency_penalty=0.3),
}


def make_sampler(requests: dict[str, SamplingParams]) -> Sampler:
    sampler = Sampler(VOCAB, "cuda")
    for request_id, params in requests.items():
        sampler.add_request(NewRequestData(request_id, [1, 2, 3], params, eos_token_ids=[0]))
    return sampler


def test_sampling_with_every_feature_never_syncs_the_host() -> None:
    sampler = make_sampler(EVERY_FEATURE)
    ids = list(EVERY_FEATURE)
    logits = torch.randn(len(ids), VOCAB, device="cuda")
    sampler.count_host_tokens(ids, sampler.sample(logits, ids).to_step_output(0, ids).token_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            result = sampler.sample(logits, ids)
            batch_changed = sampler.sample(logits[1:], ids[1:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = result.to_step_output(0, ids)
    sampler.count_host_tokens(ids, out.token_ids)
    assert out.token_ids[0] == [logits[0].argmax().item()]
    assert batch_changed.token_ids.shape == (len(ids) - 1,)
    assert out.top_logprobs is not None and len(out.top_logprobs[1][0].token_ids) == 3


def test_a_seeded_row_on_the_gpu_ignores_the_rest_of_the_batch() -> None:
    row = torch.randn(1, VOCAB, device="cuda")
    alone = make_sampler({"seeded": EVERY_FEATURE["seeded"]})
    batched = make_sampler(EVERY_FEATURE)
    ids = list(EVERY_FEATURE)
    batch = torch.randn(len(ids), VOCAB, device="cuda")
    batch[2] = row[0]
    for _ in range(10):
        expected = alone.sample(row, ["seeded"]).token_ids.tolist()[0]
        got = batched.sample(batch, ids).token_ids.tolist()
        assert got[2] == expected
        alone.count_host_tokens(["seeded"], [expected])
        batched.count_host_tokens(ids, got)
