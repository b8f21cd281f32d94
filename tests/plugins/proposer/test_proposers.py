"""The n-gram and replay proposers on their own, and the speculative metrics."""

from __future__ import annotations

import json

import pytest

from tokenloom.config import EngineConfig
from tokenloom.contrib.proposers.replay import ReplayProposer
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.plugins.proposer.ngram import NgramProposer, ngram_lookup
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.outputs import EngineStats
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    history = [1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 (followed by 4, 9, 9); [2, 3] also at 6 (-> 5, 6, 7),
    # but the longest suffix wins.
    assert ngram_lookup(history, 3, 1, 3) == [4, 9, 9]
    assert ngram_lookup(history, 3, 1, 2) == [5, 6, 7]  # latest occurrence of [2, 3]
    assert ngram_lookup(history, 2, 2, 2) == [5, 6]


def test_ngram_proposes_nothing_without_a_match_and_stops_at_the_end() -> None:
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    assert ngram_lookup([7, 8, 7], 3) == [8, 7]  # only two tokens followed the match
    assert ngram_lookup([5], 3) == []
    assert ngram_lookup([1, 2, 1, 2], 0) == []


def test_ngram_window_limits_the_search() -> None:
    history = [4, 5, 6] + [0] * 50 + [4, 5]
    assert ngram_lookup(history, 1, 2, 2) == [6]
    assert ngram_lookup(history, 1, 2, 2, window=20) == []


def test_ngram_options_are_checked() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(EngineConfig(plugin={"ngram": {"min_n": 3, "max_n": 2}}))
    proposer = NgramProposer(EngineConfig(plugin={"ngram": {"min_n": 2}}))
    assert proposer.propose(["a", "b"], [[1, 2, 1, 2], [1, 2, 3, 1]], [2, 2]) == [[1, 2], []]


def _info(vocab: int) -> ModelInfo:
    return ModelInfo("m", "llama", 64, vocab, 1, 1, 1, 8, 8, None, None)


def _replay(acceptance: float, **options: object) -> ReplayProposer:
    config = EngineConfig(plugin={"replay": {"acceptance": acceptance, **options}})
    proposer = ReplayProposer(config)
    proposer.bind(_info(50))
    return proposer


def test_replay_records_finished_requests_and_replays_them() -> None:
    proposer = _replay(1.0)
    prompt = [1, 2, 3]
    proposer.add_request(NewRequestData("a", prompt, SamplingParams()))
    history = prompt + [10, 11, 12, 13, 14, 15]
    assert proposer.propose(["a"], [history], [3]) == [[]]  # nothing recorded yet
    proposer.remove_requests(["a"])
    proposer.add_request(NewRequestData("b", prompt, SamplingParams()))
    assert proposer.propose(["b"], [prompt + [10]], [3]) == [[11, 12, 13]]
    assert proposer.propose(["b"], [prompt + [10, 11, 12, 13, 14]], [3]) == [[15]]
    assert proposer.propose(["b"], [prompt + [10, 99]], [3]) == [[]]  # left the recording


def test_replay_replaces_the_chosen_fraction_with_wrong_tokens(tmp_path) -> None:
    output = list(range(5, 45))
    path = tmp_path / "rec.jsonl"
    path.write_text(json.dumps({"prompt": [1], "output": output}) + "\n")
    proposer = _replay(0.7, path=str(path), seed=3)
    right = total = 0
    for index in range(400):
        proposer.add_request(NewRequestData(f"r{index}", [1], SamplingParams()))
        drafts = proposer.propose([f"r{index}"], [[1, 5]], [30])[0]
        right += sum(d == o for d, o in zip(drafts, output[1:], strict=False))
        total += len(drafts)
        assert all(0 <= d < 50 for d in drafts)
    assert total == 400 * 30
    assert abs(right / total - 0.7) < 0.02


def test_speculative_counters_are_in_metrics() -> None:
    stats = EngineStats(
        spec_draft_tokens_total=40, spec_accepted_tokens_total=30, spec_verify_steps_total=10
    )
    assert stats.spec_acceptance_rate == 0.75
    assert stats.spec_mean_accepted_length == 4.0
    text = ServingMetrics().render(stats, True).decode()
    assert "tokenloom_spec_decode_num_draft_tokens_total 40.0" in text
    assert "tokenloom_spec_decode_num_accepted_tokens_total 30.0" in text
    assert "tokenloom_spec_decode_acceptance_rate 0.75" in text
    assert "tokenloom_spec_decode_mean_accepted_length 4.0" in text
    assert EngineStats().spec_mean_accepted_length == 0.0


def _naive_lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def test_ngram_lookup_agrees_with_a_plain_search_on_random_histories() -> None:
    import random

    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 300, 70_000])  # multi-byte ids too
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        expected = _naive_lookup(history, k, min_n, max_n)
        assert ngram_lookup(history, k, min_n, max_n) == expected, (history, k, min_n, max_n)
