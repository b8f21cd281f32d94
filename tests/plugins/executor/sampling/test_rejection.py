"""Rejection sampling of drafts: greedy matching, exact distributions, processed rows.

The statistical tests use Pearson's chi-square against the exact target
distribution, rejecting at significance 1e-4 (critical value by the Wilson-Hilferty
approximation): a correct sampler fails one of them about once in 10,000 runs, a
biased one (accepting every draft the target could produce) fails every time.
"""

from __future__ import annotations

import math

import torch

from tokenloom.plugins.executor.sampling.rejection import (
    greedy_verify,
    rejection_sample,
    row_layout,
)
from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

VOCAB = 6
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4


def chi_square_critical(dof: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty: the chi-square quantile whose normal quantile is ``z``."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` over cells with p > 0 (a
    count in a zero-probability cell is an infinite statistic)."""
    total = counts.sum().item()
    if (counts[probs == 0] > 0).any():
        return math.inf, 1
    live = probs > 0
    expected = probs[live] * total
    stat = ((counts[live] - expected) ** 2 / expected).sum().item()
    return stat, int(live.sum().item()) - 1


def layout_tensor(num_drafts: list[int]) -> torch.Tensor:
    return torch.tensor(row_layout(num_drafts), dtype=torch.int64)


def test_row_layout_gives_each_request_its_rows_padded() -> None:
    assert row_layout([2, 0, 1]) == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]


def test_greedy_accepts_the_argmax_prefix_and_corrects_the_first_miss() -> None:
    probs = torch.full((7, VOCAB), 0.01)
    argmax = [3, 1, 4, 2, 5, 0, 2]
    probs[torch.arange(7), torch.tensor(argmax)] = 0.9
    # request 0: drafts [3, 1] both right -> bonus 4; request 1: drafts [2, 9->0] first right,
    # second wrong -> correction 0 at its second row.
    drafts = torch.tensor([3, 1, -1, 2, 3, -1, -1])
    layout = layout_tensor([2, 2]).clone()
    layout[1] = torch.tensor([3, 4, 5])
    extra = torch.tensor([[6, -1, -1]])  # request 2: no drafts, row 6 -> its argmax
    layout = torch.cat([layout, extra])
    greedy = torch.ones(7, dtype=torch.bool)
    tokens, accepted = rejection_sample(
        probs, drafts, greedy, layout, torch.rand(7), torch.empty(7, VOCAB).exponential_()
    )
    assert accepted.tolist() == [2, 1, 0]
    assert tokens[0].tolist() == [3, 1, 4]
    assert tokens[1, :2].tolist() == [2, 5]  # row 4's argmax is 5, the draft was 3
    assert tokens[2, 0].item() == 2


def _sampled_run(
    p: torch.Tensor, q: torch.Tensor | None, draws: int, biased: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``draws`` requests with two drafts each from ``q`` (uniform when None, then the
    proposer is one-hot); context-free target ``p`` at every row, so each emitted
    token must be distributed as ``p``. Returns counts of the first and second
    emitted tokens."""
    k = 2
    rows = draws * (k + 1)
    probs = p.expand(rows, VOCAB).contiguous()
    source = q if q is not None else torch.full((VOCAB,), 1.0 / VOCAB)
    drafts = torch.multinomial(source, draws * k, replacement=True).view(draws, k)
    draft_rows = torch.cat([drafts, torch.full((draws, 1), -1)], dim=1).reshape(-1)
    layout = torch.arange(rows).view(draws, k + 1)
    q_rows = q.expand(rows, VOCAB).contiguous() if q is not None else None
    uniform = torch.zeros(rows) if biased else torch.rand(rows)
    tokens, accepted = rejection_sample(
        probs,
        draft_rows,
        torch.zeros(rows, dtype=torch.bool),
        layout,
        uniform,
        torch.empty(rows, VOCAB).exponential_(),
        q_rows,
    )
    first = torch.bincount(tokens[:, 0], minlength=VOCAB).float()
    # The second token exists where the first draft was accepted.
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=VOCAB).float()
    return first, second


def test_sampled_tokens_follow_the_target_with_a_one_hot_proposer() -> None:
    torch.manual_seed(0)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    first, second = _sampled_run(p, None, 60_000)
    for counts in (first, second):
        stat, dof = chi_square(counts, p)
        assert stat < chi_square_critical(dof), (stat, counts)


def test_sampled_tokens_follow_the_target_with_a_general_draft_distribution() -> None:
    torch.manual_seed(1)
    p = torch.tensor([0.05, 0.5, 0.2, 0.1, 0.15, 0.0])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
    first, second = _sampled_run(p, q, 60_000)
    for counts in (first, second):
        stat, dof = chi_square(counts, p)
        assert stat < chi_square_critical(dof), (stat, counts)


def test_a_biased_acceptance_rule_fails_the_distribution_test() -> None:
    torch.manual_seed(2)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    first, _ = _sampled_run(p, None, 60_000, biased=True)  # accepts every draft with p > 0
    stat, dof = chi_square(first, p)
    assert stat > chi_square_critical(dof)


def test_draft_rows_are_processed_as_sampling_would_one_token_at_a_time() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        min_tokens=2,
    )
    vocab = 16
    logits = torch.randn(3, vocab)
    drafts = [4, 7]

    spec = Sampler(vocab, "cpu")
    spec.add_request(NewRequestData("r", [1, 2, 3], params, [0]))
    probs, greedy, _, _ = spec.process_draft_rows(logits, ["r"] * 3, [[], [4], [4, 7]])

    plain = Sampler(vocab, "cpu")
    plain.add_request(NewRequestData("r", [1, 2, 3], params, [0]))
    for row in range(3):
        expected = plain.process_logits(logits[row : row + 1], ["r"]).softmax(dim=-1)[0]
        assert torch.allclose(probs[row], expected, atol=1e-6), row
        if row < len(drafts):
            plain.count_host_tokens(["r"], [[drafts[row]]])
    assert not greedy.any()
    assert probs[0, 0] == 0 and probs[1, 0] == 0  # EOS masked until min_tokens
    assert probs[2, 0] > 0 or logits[2, 0] < logits[2].sort().values[-5]


def test_greedy_verify_equals_rejection_sampling_of_greedy_rows() -> None:
    torch.manual_seed(3)
    num_drafts = [3, 0, 2, 1]
    layout = layout_tensor(num_drafts)
    rows = sum(k + 1 for k in num_drafts)
    probs = torch.rand(rows, VOCAB).softmax(dim=-1)
    argmax = probs.argmax(dim=-1)
    # Drafts: the argmax at some rows, something else at others; -1 on each last row.
    drafts = torch.where(torch.rand(rows) < 0.7, argmax, (argmax + 1) % VOCAB)
    for row in layout.clamp(min=0).max(dim=1).values.tolist():
        drafts[row] = -1
    full = rejection_sample(
        probs,
        drafts,
        torch.ones(rows, dtype=torch.bool),
        layout,
        torch.rand(rows),
        torch.empty(rows, VOCAB).exponential_(),
    )
    fast = greedy_verify(argmax, drafts, layout)
    assert torch.equal(full[1], fast[1])
    for b, accepted in enumerate(fast[1].tolist()):
        assert torch.equal(full[0][b, : accepted + 1], fast[0][b, : accepted + 1])
