"""Which batches the Sampler sends to the fused Gumbel-max draw (temperature only,
unseeded, after penalties), which keep the unfused one bit for bit, and the start-up
warm-up that compiles the fused draw (the kernel itself: test_fused_sample.py)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.executor.sampling import fused_sample as fused
from tokenloom.plugins.executor.sampling.fused_sample import fused_sample
from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Spy:
    """Wraps ``fused_sample``: records each call's arguments, returns the real draw."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.stores: list[fused.Store | None] = []
        self.splits: list[int | None] = []

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seed: int,
        num_splits: int | None = None,
        store: fused.Store | None = None,
    ) -> torch.Tensor:
        self.calls.append((logits, temperature, seed))
        self.stores.append(store)
        self.splits.append(num_splits)
        return fused_sample(logits, temperature, seed, num_splits, block=16, store=store)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    spy = Spy()
    monkeypatch.setattr(fused, "fused_sample", spy)
    return spy


def fused_sampler(requests: dict[str, SamplingParams], vocab: int = 32) -> Sampler:
    sampler = Sampler(vocab, DEVICE)
    sampler.use_fused_sample = True  # on the CPU the kernel runs under TRITON_INTERPRET=1
    for request_id, params in requests.items():
        sampler.add_request(NewRequestData(request_id, [1, 2, 3], params, eos_token_ids=[0]))
    return sampler


def test_a_temperature_only_batch_sends_the_raw_logits_to_the_fused_draw(spy: Spy) -> None:
    sampler = fused_sampler(
        {
            "a": SamplingParams(temperature=0.8),
            "g": SamplingParams(temperature=0.0),
            "b": SamplingParams(temperature=1.2, logprobs=2),
        }
    )
    ids = ["a", "g", "b"]
    logits = torch.randn(3, 32, device=DEVICE)
    for _ in range(2):
        result = sampler.sample(logits, ids)
        assert result.token_ids[1] == logits[1].argmax()
    assert len(spy.calls) == 2
    given, temperature, _ = spy.calls[0]
    assert given is logits  # no division, no copy: the kernel applies T itself
    assert temperature.tolist() == pytest.approx([0.8, 0.0, 1.2])
    assert spy.calls[0][2] != spy.calls[1][2]  # a fresh seed per step
    assert result.logprobs is not None  # logprobs still come from the raw logits


def test_penalties_and_min_tokens_are_applied_before_the_fused_draw(spy: Spy) -> None:
    sampler = fused_sampler(
        {"m": SamplingParams(temperature=1.0, min_tokens=3, repetition_penalty=1.5)}
    )
    logits = torch.zeros(1, 32, device=DEVICE)
    logits[0, 0] = 30.0  # EOS: certain, once min_tokens allows it
    logits[0, 1] = 3.0  # a prompt token: the repetition penalty divides it by 1.5
    for step in range(4):
        token = sampler.sample(logits, ["m"]).token_ids[0].item()
        sampler.count_host_tokens(["m"], [token])
        assert (token == 0) == (step == 3)
    assert len(spy.calls) == 4
    seen = spy.calls[0][0]
    assert seen[0, 0] == float("-inf") and seen[0, 1].item() == pytest.approx(2.0)
    assert spy.calls[3][0][0, 0] == 30.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=4),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=5),
        SamplingParams(temperature=0.9, min_p=0.1),
    ],
    ids=["seeded", "top-p", "top-k", "min-p"],
)
def test_seeded_or_filtered_rows_keep_the_unfused_draw_bit_for_bit(spy, params) -> None:
    requests = {"x": params, "t": SamplingParams(temperature=1.1)}
    logits = torch.randn(2, 32, device=DEVICE)
    draws = []
    for use_fused in (True, False):
        sampler = fused_sampler(requests)
        sampler.use_fused_sample = use_fused
        torch.manual_seed(11)
        draws.append([sampler.sample(logits, ["x", "t"]).token_ids for _ in range(5)])
    assert spy.calls == []
    assert all(torch.equal(a, b) for a, b in zip(*draws, strict=True))


def test_a_greedy_only_batch_takes_the_kernel_s_noiseless_argmax(spy: Spy) -> None:
    sampler = fused_sampler({f"g{i}": SamplingParams(temperature=0.0) for i in range(3)})
    logits = torch.randn(3, 32, device=DEVICE)
    assert torch.equal(sampler.sample(logits, ["g0", "g1", "g2"]).token_ids, logits.argmax(-1))
    assert len(spy.calls) == 1 and spy.calls[0][1] is None  # no temperature: no noise
    unfused = fused_sampler({"g": SamplingParams(temperature=0.0)})
    unfused.use_fused_sample = False  # the CPU default: torch's argmax
    assert torch.equal(unfused.sample(logits[:1], ["g"]).token_ids, logits[:1].argmax(-1))
    assert len(spy.calls) == 1


def test_a_greedy_batch_with_penalties_takes_the_noiseless_argmax_of_the_processed_logits(
    spy: Spy,
) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    sampler = fused_sampler({"p": params, "q": params})
    logits = torch.randn(2, 32, device=DEVICE) * 0.1
    logits[:, 5] = 1.0
    logits[:, 2] = 1.2  # token 2 is in the prompt: 1.2 / 1.5 falls below token 5
    expected = sampler._process(logits, sampler._batch_for(["p", "q"])).argmax(-1)
    assert expected.tolist() == [5, 5] and logits.argmax(-1).tolist() == [2, 2]
    assert torch.equal(sampler.sample(logits, ["p", "q"]).token_ids, expected)
    assert len(spy.calls) == 1 and spy.calls[0][1] is None


def test_the_fused_draw_is_off_by_default_on_the_cpu() -> None:
    assert not Sampler(32, "cpu").use_fused_sample


def test_warm_up_compiles_the_fused_draw_for_the_vocabulary_once(spy: Spy) -> None:
    # start-up runs the kernel once on one row of the model's vocabulary (so Triton
    # compiles it then, not on the first sampled step); off the fused path, nothing
    sampler = Sampler(40, DEVICE)
    sampler.use_fused_sample = True
    sampler.warm_up()
    # the draw and the greedy argmax, each without and with the token store, and with the
    # store in one split (the draw kernel's own STORE variant)
    assert len(spy.calls) == 6
    logits, temperature, _ = spy.calls[0]
    assert logits.shape == (1, 40) and logits.dtype == torch.float32
    assert temperature.tolist() == [1.0]
    assert [c[1] is None for c in spy.calls] == [False, True, False, True, False, True]
    assert spy.stores[:2] == [None, None] and all(s is not None for s in spy.stores[2:])
    assert spy.splits[4:] == [1, 1]
    store = spy.stores[2]
    assert store is not None and store[0] is not store[1]  # a slot must not be a target
    unfused = Sampler(40, DEVICE)
    unfused.use_fused_sample = False
    unfused.warm_up()
    assert len(spy.calls) == 6


def test_the_executor_warms_the_sampler_up_at_load(monkeypatch, tiny_model_factory) -> None:
    from tokenloom import LLM

    warmed: list[int] = []
    monkeypatch.setattr(Sampler, "warm_up", lambda self: warmed.append(self.vocab_size))
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32")
    assert warmed == [llm.engine.executor.sampler.vocab_size]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_fused_kernels_store_the_token_for_the_next_step(temperature: float) -> None:
    # The executor hands ``sample`` its next-step token buffer and the rows' slots there:
    # the kernel that finds each id writes it (int32), and the result says so.
    sampler = fused_sampler({r: SamplingParams(temperature=temperature) for r in "ab"})
    logits = torch.randn(2, 32, device=DEVICE)
    tokens = torch.full((6,), -7, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    result = sampler.sample(logits, ["a", "b"], (tokens, slots))
    assert result.stored
    expected = [-7] * 6
    expected[4], expected[1] = result.token_ids.tolist()
    assert tokens.tolist() == expected
    # off the fused path (a filter), nothing is stored and the executor does it
    filtered = fused_sampler({"a": SamplingParams(temperature=0.8, top_k=3)})
    before = tokens.clone()
    assert not filtered.sample(logits[:1], ["a"], (tokens, slots[:1])).stored
    assert torch.equal(tokens, before)
