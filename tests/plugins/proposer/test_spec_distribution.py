"""Sampled output keeps its distribution under speculative decoding.

A 12-token-vocabulary model samples 1,500 four-token continuations at temperature
1 with top-p 0.9, without speculation and with a proposer that drafts uniformly
random tokens (so many drafts are accepted and many rejected). Tokens 2-4 come out
of verify steps. Test: Pearson's chi-square test of homogeneity between the two
runs, on each position's token and on the (token 2, token 3) pair, cells with fewer
than 10 samples pooled; it fails at significance 1e-4 (Wilson-Hilferty critical
value). A deliberately biased acceptance rule (accept every draft the target could
produce) must fail the same test.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.plugin_manager import PluginManager
from tokenloom.plugins.executor import speculative
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams

VOCAB = 12
SAMPLES = 1500
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4


def chi_square_critical(dof: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty: the chi-square quantile whose normal quantile is ``z``."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


class RandomDrafts(Proposer):
    """Uniform random drafts: independent of the target, a valid one-hot proposal."""

    name = "random-drafts"

    def __init__(self, config: object) -> None:
        self._rng = random.Random(1234)

    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        return [[self._rng.randrange(VOCAB) for _ in range(k)] for k in num_tokens]


class _Plugin:
    @hookimpl
    def tokenloom_register_components(self) -> list[ComponentSpec]:
        return [ComponentSpec("proposer", "random-drafts", RandomDrafts, "test")]


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    from tokenloom.checkpoints.tiny_models import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-vocab")
    return write_tiny_model(
        path, "llama", num_layers=1, config_overrides={"vocab_size": VOCAB}, seed=3
    )


def sample_continuations(model_dir: object, **options: object) -> list[tuple[int, ...]]:
    torch.manual_seed(0)
    pm = PluginManager.default()
    pm.register(_Plugin(), "random-drafts")
    config = load_config(
        model=str(model_dir), device="cpu", num_blocks=2048, block_size=4, max_num_seqs=512,
        **options,
    )  # fmt: skip
    engine = Engine.from_config(config, pm)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)
    for index in range(SAMPLES):
        engine.add_request(GenerateRequest(f"s{index}", [1, 5, 7, 2, 9], params))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [tuple(tokens) for tokens in out.values()]


def homogeneity(a: list[object], b: list[object]) -> tuple[float, float]:
    """Chi-square statistic of two samples over pooled cells, and its critical value."""
    ca, cb = Counter(a), Counter(b)
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for key in set(ca) | set(cb):
        if ca[key] + cb[key] < 10:
            rare[0] += ca[key]
            rare[1] += cb[key]
        else:
            cells.append((ca[key], cb[key]))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, chi_square_critical(max(len(cells) - 1, 1))


def distribution_gaps(spec: list[tuple[int, ...]], plain: list[tuple[int, ...]]) -> list[bool]:
    """For positions 2, 3, 4 and the pair (2, 3): does the test find a difference?"""
    failed = []
    for select in (lambda t: t[1], lambda t: t[2], lambda t: t[3], lambda t: t[1:3]):
        stat, critical = homogeneity([select(t) for t in spec], [select(t) for t in plain])
        failed.append(stat > critical)
    return failed


@pytest.fixture(scope="module")
def plain_samples(tiny_vocab_model) -> list[tuple[int, ...]]:
    return sample_continuations(tiny_vocab_model)


def test_sampled_continuations_match_without_and_with_speculation(
    tiny_vocab_model, plain_samples
) -> None:
    spec = sample_continuations(
        tiny_vocab_model, proposer="random-drafts", num_speculative_tokens=3
    )
    assert len(spec) == len(plain_samples) == SAMPLES
    assert all(len(t) == 4 for t in spec)
    assert distribution_gaps(spec, plain_samples) == [False] * 4


def test_a_biased_acceptance_rule_is_caught(tiny_vocab_model, plain_samples, monkeypatch) -> None:
    exact = speculative.rejection_sample

    def accept_whenever_possible(probs, drafts, greedy, layout, uniform, noise, q=None):
        return exact(probs, drafts, greedy, layout, torch.zeros_like(uniform), noise, q)

    monkeypatch.setattr(speculative, "rejection_sample", accept_whenever_possible)
    spec = sample_continuations(
        tiny_vocab_model, proposer="random-drafts", num_speculative_tokens=3
    )
    assert any(distribution_gaps(spec, plain_samples))
