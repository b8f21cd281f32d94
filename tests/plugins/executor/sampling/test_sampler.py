"""The device sampler: greedy, temperature, seeds, truncation filters, logprobs."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

VOCAB = 32


def make_sampler(requests: dict[str, SamplingParams], vocab: int = VOCAB) -> Sampler:
    sampler = Sampler(vocab, "cpu")
    for request_id, params in requests.items():
        sampler.add_request(NewRequestData(request_id, [1, 2, 3], params))
    return sampler


def draw_sequence(sampler: Sampler, logits: torch.Tensor, ids: list[str], steps: int) -> list:
    tokens = []
    for _ in range(steps):
        out = sampler.sample(logits, ids).to_step_output(0, ids)
        sampler.count_host_tokens(ids, out.token_ids)
        tokens.append([row[0] for row in out.token_ids])
    return tokens


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(6, VOCAB)
    sampler = make_sampler({f"r{i}": SamplingParams(temperature=0.0) for i in range(6)})
    result = sampler.sample(logits, [f"r{i}" for i in range(6)])
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert result.logprobs is None


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = torch.randn(4, VOCAB)
    sampler = make_sampler(
        {
            "g0": SamplingParams(temperature=0.0, top_k=3),
            "s1": SamplingParams(temperature=1.5, top_p=0.5),
            "g2": SamplingParams(temperature=0.0),
            "s3": SamplingParams(temperature=0.7, min_p=0.1),
        }
    )
    for _ in range(10):
        tokens = sampler.sample(logits, ["g0", "s1", "g2", "s3"]).token_ids
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_the_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    logits = torch.zeros(1, VOCAB)
    runs = []
    for seed in (7, 7, 8):
        sampler = make_sampler({"a": SamplingParams(temperature=1.0, seed=seed)})
        runs.append(draw_sequence(sampler, logits, ["a"], steps=20))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_a_seeded_row_gives_the_same_tokens_alone_or_batched() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0.9, top_k=20, seed=1234)
    alone = draw_sequence(make_sampler({"a": params}), row, ["a"], steps=15)
    others = {f"o{i}": SamplingParams(temperature=1.0, seed=i if i % 2 else None) for i in range(3)}
    batched_sampler = make_sampler({"a": params, **others})
    ids = ["o0", "a", "o1", "o2"]
    batch = torch.cat([torch.randn(1, VOCAB), row, torch.randn(2, VOCAB)])
    batched = draw_sequence(batched_sampler, batch, ids, steps=15)
    assert [step[0] for step in alone] == [step[1] for step in batched]


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, VOCAB)
    ids = [f"r{i}" for i in range(64)]
    sampler = make_sampler({i: SamplingParams(temperature=2.0, top_k=1) for i in ids})
    assert torch.equal(sampler.sample(logits, ids).token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(64, VOCAB)
    ids = [f"r{i}" for i in range(64)]
    sampler = make_sampler({i: SamplingParams(temperature=2.0, top_p=1e-6) for i in ids})
    assert torch.equal(sampler.sample(logits, ids).token_ids, logits.argmax(dim=-1))


def test_top_k_keeps_exactly_k_tokens_per_row_and_samples_only_them() -> None:
    logits = torch.randn(3, VOCAB)
    sampler = make_sampler(
        {
            "k2": SamplingParams(top_k=2),
            "k5": SamplingParams(top_k=5),
            "off": SamplingParams(top_k=0),
        }
    )
    processed = sampler.process_logits(logits, ["k2", "k5", "off"])
    assert torch.isfinite(processed).sum(dim=-1).tolist() == [2, 5, VOCAB]
    top2 = set(logits[0].topk(2).indices.tolist())
    for _ in range(20):
        token = sampler.sample(logits, ["k2", "k5", "off"]).token_ids[0].item()
        assert token in top2


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 3)
    logits = probs.log()
    sampler = make_sampler(
        {
            "p70": SamplingParams(top_p=0.7),
            "p81": SamplingParams(top_p=0.81),
            "both": SamplingParams(top_p=0.9, top_k=1),
        },
        vocab=4,
    )
    kept = torch.isfinite(sampler.process_logits(logits, ["p70", "p81", "both"]))
    assert kept.tolist() == [
        [False, True, False, True],
        [False, True, True, True],
        [False, True, False, False],
    ]


def test_the_topk_shortcut_keeps_the_same_tokens_as_the_full_sort() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    rows = {
        "greedy": SamplingParams(temperature=0.0),
        "k4p": SamplingParams(top_k=4, top_p=0.6),
        "k9p": SamplingParams(top_k=9, top_p=0.8),
    }
    shortcut = make_sampler(rows)  # every row has a top-k: candidates from topk
    full = make_sampler({**rows, "nok": SamplingParams(top_p=0.5)})  # full sort
    kept_shortcut = torch.isfinite(shortcut.process_logits(logits, list(rows)))
    kept_full = torch.isfinite(full.process_logits(torch.cat([logits, logits[:1]]), [*rows, "nok"]))
    assert torch.equal(kept_shortcut, kept_full[:3])
    assert kept_shortcut.sum(dim=-1).tolist()[0] == 1
    assert 1 <= kept_shortcut[1].sum() <= 4 and 1 <= kept_shortcut[2].sum() <= 9


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    sampler = make_sampler({"m": SamplingParams(min_p=0.4)}, vocab=4)
    kept = torch.isfinite(sampler.process_logits(logits, ["m"]))
    assert kept.tolist() == [[False, True, False, True]]


def test_temperature_sampling_matches_the_softmax_distribution() -> None:
    torch.manual_seed(0)
    vocab, rows, temperature = 6, 60_000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    ids = [f"r{i}" for i in range(rows)]
    sampler = make_sampler({i: SamplingParams(temperature=temperature) for i in ids}, vocab)
    tokens = sampler.sample(row.expand(rows, vocab), ids).token_ids
    observed = torch.bincount(tokens, minlength=vocab).double()
    expected = (row / temperature).softmax(dim=-1).double() * rows
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 5 degrees of freedom: p < 1e-4 of failing by chance


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    sampler = Sampler(VOCAB, "cpu")
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    sampler.add_request(NewRequestData("a", [1], params, eos_token_ids=[3]))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0
    logits[0, 5] = 9.0
    logits[0, 7] = 8.0
    tokens = draw_sequence(sampler, logits, ["a"], steps=3)
    assert tokens == [[7], [7], [3]]


def test_logprobs_are_the_raw_log_softmax_and_trimmed_per_request() -> None:
    logits = torch.randn(3, VOCAB)
    sampler = make_sampler(
        {
            "two": SamplingParams(temperature=0.5, top_k=3, logprobs=2),
            "none": SamplingParams(temperature=0.0),
            "zero": SamplingParams(temperature=0.0, logprobs=0),
        }
    )
    result = sampler.sample(logits, ["two", "none", "zero"])
    raw = logits.log_softmax(dim=-1)
    assert result.logprobs is not None and result.top_ids is not None
    assert torch.allclose(result.logprobs, raw.gather(1, result.token_ids[:, None]).squeeze(1))
    assert torch.equal(result.top_ids, raw.topk(2).indices)
    step = result.to_step_output(4, ["two", "none", "zero"])
    assert step.top_logprobs is not None
    top = [row[0] for row in step.top_logprobs]
    assert top[0].token_ids == raw[0].topk(2).indices.tolist()
    assert top[0].logprobs == pytest.approx(raw[0].topk(2).values.tolist())
    assert top[1].token_ids == [] and top[2].token_ids == []
    assert step.token_ids == [[t] for t in result.token_ids.tolist()]


def test_rows_follow_their_request_when_the_batch_order_changes() -> None:
    logits = torch.randn(2, VOCAB)
    sampler = make_sampler(
        {"g": SamplingParams(temperature=0.0), "k1": SamplingParams(temperature=1.0, top_k=1)}
    )
    first = sampler.sample(logits, ["g", "k1"]).token_ids
    swapped = sampler.sample(logits.flip(0), ["k1", "g"]).token_ids
    assert torch.equal(first, logits.argmax(-1))
    assert torch.equal(swapped, first.flip(0))


def test_removed_requests_lose_their_state() -> None:
    sampler = make_sampler({"a": SamplingParams(repetition_penalty=1.3)})
    sampler.remove_requests(["a", "unknown"])
    assert not sampler.has_request("a")
    with pytest.raises(KeyError):
        sampler.sample(torch.zeros(1, VOCAB), ["a"])
