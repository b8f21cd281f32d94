"""The fused Gumbel-max sampler: its distribution, greedy rows, masked tokens, seeds,
the split path, and its speed on the GPU (which batches the Sampler sends to it:
test_fused_routing.py).

On the CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest) on tiny shapes;
the interpreter runs one program at a time, ~10 ms each, so the distribution tests use
a few hundred rows. The ``gpu`` tests check the real vocabulary size and time it.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import triton
import triton.language as tl

from tokenloom.plugins.executor.sampling import fused_sample as fused
from tokenloom.plugins.executor.sampling.fused_sample import fused_sample, host_seed
from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW = torch.linspace(-2.0, 2.0, 8)  # V = 8
CHI2_DF7_P001 = 24.3  # chi-square, 7 degrees of freedom: exceeded by chance with p = 0.001


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * tokens.numel()
    return ((observed - expected) ** 2 / expected).sum().item()


def mean_z_score(tokens: torch.Tensor, row: torch.Tensor, probs: torch.Tensor) -> float:
    """How many standard errors the drawn logits' mean lies from its expectation."""
    x, p = row.double().cpu(), probs.double().cpu()
    mean, var = (p * x).sum(), (p * x * x).sum() - (p * x).sum() ** 2
    return ((x[tokens.cpu()].mean() - mean) / (var / tokens.numel()).sqrt()).item()


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_draws_follow_the_softmax_at_the_rows_temperature(temperature: float) -> None:
    rows = 500  # ~6 s interpreted
    logits = ROW.expand(rows, -1).contiguous().to(DEVICE)
    temperatures = torch.full((rows,), temperature, device=DEVICE)
    tokens = fused_sample(logits, temperatures, seed=1234, block=16).cpu()
    probs = (ROW / temperature).softmax(-1)
    assert chi_square(tokens, probs) < CHI2_DF7_P001
    assert abs(mean_z_score(tokens, ROW, probs)) < 4.0
    # The bounds catch a kernel that ignored T (drew from softmax(x)) or the noise (always
    # the argmax): these counts would fail them against either distribution.
    assert chi_square(tokens, ROW.softmax(-1)) > CHI2_DF7_P001
    assert abs(mean_z_score(tokens, ROW, ROW.softmax(-1))) > 4.0
    assert (tokens == ROW.argmax()).sum() < 0.9 * rows


def test_greedy_rows_take_the_argmax_and_masked_tokens_never_win() -> None:
    torch.manual_seed(0)
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab) * 3
    masked = torch.rand(rows, vocab) < 0.5
    logits[masked] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 33] = -50.0  # the only finite logit of its row
    masked[5, :] = True
    masked[5, 33] = False
    logits, masked = logits.to(DEVICE), masked.to(DEVICE)
    temperature = torch.tensor([0.0, 5.0, 0.0, 5.0, 1.0, 5.0], device=DEVICE)
    sampled = []
    for seed in (1, 2, 3):
        tokens = fused_sample(logits, temperature, seed=seed, block=16)
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
        assert not masked.gather(1, tokens.view(-1, 1)).any()
        assert tokens[5] == 33
        sampled.append(tokens[[1, 3]])
    assert len({tuple(t.tolist()) for t in sampled}) > 1  # T = 5 rows do vary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_kernel_is_torch_s_argmax_ties_to_the_lowest_index(dtype) -> None:
    # temperature None: no noise at all (the all-greedy batch), whatever the split
    torch.manual_seed(3)
    rows, vocab = 5, 61
    logits = torch.randint(-3, 4, (rows, vocab)).to(dtype)  # many ties per row
    logits[1, :] = float("-inf")  # all masked: index 0, as torch
    logits[2, 60] = 9.0  # the last element, in a partial block
    logits[3, 17] = logits[3, 40] = 9.0  # a tie across splits
    logits = logits.to(DEVICE)
    expected = logits.float().argmax(dim=-1)
    assert expected.tolist()[1:4] == [0, 60, 17]
    for splits in (1, 2, 4):
        got = fused_sample(logits, None, 2**32, num_splits=splits, block=16)
        assert torch.equal(got, expected), (splits, got.tolist(), expected.tolist())
    assert torch.equal(fused.greedy_argmax(logits), expected)


def test_the_greedy_kernel_skips_a_nan_which_torch_s_argmax_picks() -> None:
    logits = torch.tensor([[0.0, float("nan"), 2.0, 1.0]], device=DEVICE)
    assert fused.greedy_argmax(logits).tolist() == [2]
    assert logits.argmax(dim=-1).tolist() == [1]


@pytest.mark.parametrize("vocab", [64, 61])
def test_splitting_a_row_across_programs_gives_the_same_ids(vocab: int) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, vocab, device=DEVICE)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0], device=DEVICE)
    one = fused_sample(logits, temperature, seed=99, num_splits=1, block=16)
    for splits in (2, 3, 4):
        assert torch.equal(fused_sample(logits, temperature, 99, num_splits=splits, block=16), one)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_store_writes_each_rows_id_at_its_slot(splits: int) -> None:
    # one split: the draw's program stores; several: the reduction's
    torch.manual_seed(2)
    logits = torch.randn(3, 61, device=DEVICE)
    temperature = torch.tensor([1.0, 0.0, 0.5], device=DEVICE)
    plain = fused_sample(logits, temperature, 11, num_splits=splits, block=16)
    tokens = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
    stored = fused_sample(
        logits, temperature, 11, num_splits=splits, block=16, store=(tokens, slots)
    )
    assert torch.equal(stored, plain)
    ids = plain.tolist()
    assert tokens.tolist() == [ids[1], -1, ids[2], ids[0], -1]


def test_the_split_reduction_compiles_once_whatever_the_split_count(monkeypatch) -> None:
    # The split count follows the batch size (default_num_splits): a block size tied to it
    # compiled a new reduction (seven on the H200's 128k vocabulary) each time a serving
    # batch first grew past 35, 69, 106, 141, 264 or 528 rows, stalling that step.
    blocks: list[int] = []
    kernel = fused._reduce_splits_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                blocks.append(kwargs["BLOCK_S"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(fused, "_reduce_splits_kernel", Recorder())
    logits = torch.randn(2, 61, device=DEVICE)  # 4 blocks of 16
    temperature = torch.ones(2, device=DEVICE)
    for splits in (2, 3, 4):
        fused_sample(logits, temperature, 3, num_splits=splits, block=16)
    assert len(blocks) == 3 and len(set(blocks)) == 1


def test_the_same_seed_repeats_the_draw_and_another_seed_does_not() -> None:
    logits = torch.zeros(16, 64, device=DEVICE)  # flat: every id equally likely
    temperature = torch.ones(16, device=DEVICE)
    first = fused_sample(logits, temperature, seed=5, block=16)
    assert torch.equal(fused_sample(logits, temperature, seed=5, block=16), first)
    assert not torch.equal(fused_sample(logits, temperature, seed=6, block=16), first)
    assert len(set(first.tolist())) > 4


def test_an_infinite_temperature_draws_uniformly_as_the_unfused_sampler() -> None:
    # A request's temperature of 1e39 is finite in the API and inf as the batch's float32:
    # the unfused draw divides the logits to 0 and picks uniformly. T * G must not
    # overflow to +inf (every positive-noise token then ties and the lowest id wins).
    rows = 200
    logits = ROW.expand(rows, -1).contiguous().to(DEVICE)
    temperature = torch.full((rows,), float("inf"), device=DEVICE)
    tokens = fused_sample(logits, temperature, seed=7, block=16).cpu()
    assert chi_square(tokens, torch.full((8,), 1 / 8)) < CHI2_DF7_P001
    masked = logits.clone()
    masked[:, 0] = float("-inf")  # a masked token stays out
    assert (fused_sample(masked, temperature, seed=7, block=16) != 0).all()


def test_the_host_seed_follows_torch_manual_seed() -> None:
    torch.manual_seed(3)
    a = [host_seed(), host_seed()]
    torch.manual_seed(3)
    assert [host_seed(), host_seed()] == a and a[0] != a[1]


# ---------------------------------------------------------------------- on the GPU

BIG_VOCAB = 128_256


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_gpu_draws_follow_the_softmax(temperature: float) -> None:
    rows = 50_000
    logits = ROW.cuda().expand(rows, -1).contiguous()
    temps = torch.full((rows,), temperature, device="cuda")
    tokens = fused_sample(logits, temps, host_seed())
    assert chi_square(tokens, (ROW / temperature).softmax(-1)) < 2 * CHI2_DF7_P001


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_greedy_argmax_is_torch_s_at_the_full_vocabulary(rows: int, dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randint(-50, 50, (rows, BIG_VOCAB), device="cuda", generator=gen).to(dtype)
    logits[0, 5] = logits[0, BIG_VOCAB - 1] = 60  # a tie at both ends of the row
    assert torch.equal(fused.greedy_argmax(logits), logits.argmax(dim=-1))
    assert fused.greedy_argmax(logits)[0].item() == 5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 128, 256])
def test_gpu_full_vocab_draws_land_on_likely_tokens(rows: int) -> None:
    """Half the vocabulary sits 40 nats below the rest (odds ~1e-17 each) and a tenth is
    -inf: no draw may land there. The drawn logits' sum matches its expectation under
    softmax(x / T) (a z-score), and greedy rows take the argmax."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, BIG_VOCAB, device="cuda", generator=gen)
    unlikely = torch.rand(rows, BIG_VOCAB, device="cuda", generator=gen) < 0.5
    masked = torch.rand(rows, BIG_VOCAB, device="cuda", generator=gen) < 0.1
    logits = logits.masked_fill(unlikely, -40.0).masked_fill(masked, float("-inf"))
    temperature = torch.full((rows,), 0.8, device="cuda")
    temperature[3::7] = 0.0  # greedy rows (none at batch 1)
    sampled = temperature > 0
    probs = (logits / temperature.clamp(min=1e-5).view(-1, 1)).softmax(-1)
    finite = logits.masked_fill(masked, 0.0)
    mean = (probs * finite).sum(-1)
    var = (probs * finite**2).sum(-1) - mean**2
    total, expected, variance = 0.0, 0.0, 0.0
    for _ in range(20):
        tokens = fused_sample(logits, temperature, host_seed())
        assert not (unlikely | masked).gather(1, tokens.view(-1, 1)).any()
        assert torch.equal(tokens[~sampled], logits[~sampled].argmax(-1))
        total += logits.gather(1, tokens.view(-1, 1)).view(-1)[sampled].sum().item()
        expected += mean[sampled].sum().item()
        variance += var[sampled].sum().item()
    assert abs(total - expected) < 5 * variance**0.5


def temperature_sampler(rows: int, use_fused: bool) -> Sampler:
    sampler = Sampler(BIG_VOCAB, "cuda")
    sampler.use_fused_sample = use_fused
    for i in range(rows):
        sampler.add_request(NewRequestData(f"r{i}", [1], SamplingParams(temperature=1.0)))
    return sampler


@pytest.mark.gpu
def test_gpu_fused_sampling_never_syncs_the_host() -> None:
    assert Sampler(BIG_VOCAB, "cuda").use_fused_sample  # on by default on a GPU
    sampler = temperature_sampler(8, use_fused=True)
    ids = [f"r{i}" for i in range(8)]
    logits = torch.randn(8, BIG_VOCAB, device="cuda")
    sampler.sample(logits, ids)  # compile and build the batch outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.sample(logits, ids).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (8,) and bool(((tokens >= 0) & (tokens < BIG_VOCAB)).all())


def median_us(fn, repeats: int = 20) -> float:
    """Median time of ``fn()`` on the GPU in microseconds, by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


@pytest.mark.gpu
def test_gpu_fused_draw_is_faster_than_the_unfused_one_at_batch_128() -> None:
    rows = 128
    ids = [f"r{i}" for i in range(rows)]
    logits = torch.randn(rows, BIG_VOCAB, device="cuda")
    unfused_sampler = temperature_sampler(rows, use_fused=False)
    one_pass_sampler = temperature_sampler(rows, use_fused=True)
    unfused_us = median_us(lambda: unfused_sampler.sample(logits, ids))
    fused_us = median_us(lambda: one_pass_sampler.sample(logits, ids))
    print(
        f"\nsample() B={rows} V={BIG_VOCAB} T=1.0, median of 20: unfused {unfused_us:.1f} us,"
        f" fused {fused_us:.1f} us ({unfused_us / fused_us:.1f}x)"
    )
    for batch in (1, 8, 128, 256):
        x = torch.randn(batch, BIG_VOCAB, device="cuda")
        temperature = torch.ones(batch, device="cuda")
        kernel = median_us(lambda x=x, t=temperature: fused_sample(x, t, 1))
        splits = fused.default_num_splits(batch, BIG_VOCAB, x.device, fused.DEFAULT_BLOCK)
        print(
            f"fused_sample B={batch}: {kernel:.1f} us, {x.numel() * 4 / kernel / 1e3:.0f} GB/s"
            f" of logits read, {splits} splits per row"
        )
    assert fused_us < unfused_us


@triton.jit
def _uniform_probe(bits_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    u = fused._open_uniform(tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True))
    tl.store(out_ptr + offs, -tl.log(-tl.log(u)))


def test_the_extreme_random_words_give_finite_gumbel_noise() -> None:
    # The all-ones word once mapped to u = 1.0 in float32 (G = +inf: a masked or
    # far-below token could win, about once per 2^24 draws, seen at B=128 on the H200).
    words = torch.tensor([-1, 0, 1, 2**31 - 1, -(2**31), 511, 512, -512], dtype=torch.int32)
    noise = torch.empty(8, dtype=torch.float32)
    words, noise = words.to(DEVICE), noise.to(DEVICE)
    _uniform_probe[(1,)](words, noise, N=8)
    assert torch.isfinite(noise).all(), noise
    assert float(noise.max()) < 17.0 and float(noise.min()) > -3.0


def test_the_key_is_63_bits_and_its_high_half_changes_the_draw() -> None:
    # keys above 2^32 (one int64 kernel argument); two keys equal in their low 32 bits
    # draw differently, so the high half reaches Philox rather than being cut off
    torch.manual_seed(3)
    keys = [host_seed() for _ in range(64)]
    assert all(2**32 <= k < 2**63 for k in keys) and max(keys) > 2**62
    logits = torch.zeros(16, 64, device=DEVICE)
    temps = torch.ones(16, device=DEVICE)
    low = 12345
    a = fused_sample(logits, temps, (7 << 40) | low, block=16)
    b = fused_sample(logits, temps, (9 << 40) | low, block=16)
    assert not torch.equal(a, b)
    assert torch.equal(a, fused_sample(logits, temps, (7 << 40) | low, block=16))
