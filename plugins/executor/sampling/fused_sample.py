"""One-pass temperature sampling: the Gumbel-max draw fused into a Triton kernel.

The unfused draw (``Sampler._draw``: softmax, an exponential noise tensor, a divide and
an argmax) makes four or five full passes over the ``[B, V]`` float32 logits; at batch
128 and a 128k vocabulary each pass moves 66 MB, ~270 us per decode step on an H200.
This kernel reads the logits once and writes one id per row.

The draw: ``argmax_v(x_v / T + G_v)`` with ``G_v = -log(-log(U_v))`` i.i.d. standard
Gumbel and ``U_v`` uniform in (0, 1). The argmax lands on token i with probability
``softmax(x / T)_i`` (the Gumbel-max trick). It is the exponential race of
``logits_filters.exponential_race`` under another name: ``E_v = -log(U_v)`` is Exp(1) and
``argmax(p_v / E_v) = argmax(log p_v - log E_v) = argmax(x_v / T + G_v)``, the softmax's
normaliser being the same for every v. The kernel computes the equivalent
``argmax(x_v + T * G_v)`` (scaling by T > 0 keeps the argmax): no division, and a row
with T = 0 (a greedy row in a mixed batch) takes the plain argmax with no extra branch.
A -inf logit (a masked token) scores -inf and never wins over a finite one; ties go to
the lowest index, as ``torch.argmax``.

The uniforms come from Triton's Philox generator: key = the per-call ``seed``, counter =
the element's place (row, block, lane), each counter giving four uniforms. The caller
draws the seed on the host from torch's CPU default generator (``host_seed``), so no
device value is read and ``torch.manual_seed`` makes runs reproducible. The stream
depends only on the seed and the element's place, not on how the vocabulary is split
across programs, so any split gives the same ids.

Small batches split each row across several programs (grid rows x splits, enough
programs to fill the GPU); a second launch reduces the partial (value, index) pairs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Measured on the H200 (scripts/gpu/sample_bench.py, V = 128,256): 16 programs per SM
# and 2,048-element steps beat 4 and 1,024 by 9-14% at B = 128-256 (the kernel is
# latency-bound at ~1 TB/s: more programs in flight, longer steps), same at B <= 32.
Store = tuple[torch.Tensor, torch.Tensor]  # (tokens int32, slots [B] int32): see fused_sample

DEFAULT_BLOCK = 2048  # elements per program per loop step; four Philox outputs per lane
PROGRAMS_PER_SM = 16  # programs in flight per SM


@triton.jit
def _open_uniform(bits):
    """32 random bits (uint32) -> a float32 uniform in (0, 1), both ends excluded."""
    # 23 bits to a float in (0, 1), both ends excluded and exact in float32: the largest,
    # 1 - 2^-24, is representable (with 24 bits, (2^24 - 0.5) / 2^24 rounds to 1.0, and
    # G = -log(-log(1)) = +inf let a -inf or far-below token win about once per 2^24
    # draws). G stays in (-2.8, 16.7).
    return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _gumbel_score(logits_ptr, offs, hi, bits, temperature, GREEDY: tl.constexpr):
    """``x + T * G`` for the elements ``offs`` (-inf past ``hi``), G from 32 random bits;
    ``x`` alone when ``GREEDY``."""
    x = tl.load(logits_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
    if GREEDY:
        return x
    u = _open_uniform(bits)
    gumbel = -tl.log(-tl.log(u))
    return x + temperature * gumbel


@triton.jit
def _keep_best(best_val, best_idx, score, offs):
    """Lane-wise running max; a later element replaces only a strictly larger score, so
    each lane keeps its lowest index among ties."""
    better = score > best_val
    return tl.where(better, score, best_val), tl.where(better, offs, best_idx)


@triton.jit
def _lowest_argmax(values, indices):
    """(max, lowest index holding it) of a block of (value, index) pairs."""
    best = tl.max(values, axis=0)
    index = tl.min(tl.where(values == best, indices, 2147483647), axis=0)
    return best, index


@triton.jit(do_not_specialize=["seed"])
def _gumbel_max_kernel(
    logits_ptr,  # [B, V] float
    temperature_ptr,  # [B] float32; 0 = greedy
    part_val_ptr,  # [B, S] float32
    part_idx_ptr,  # [B, S] int64
    stride_row,
    vocab,
    chunk,  # elements per split, a multiple of BLOCK
    counters_per_row,  # Philox counters a row uses: cdiv(V, BLOCK) * BLOCK / 4
    seed,
    store_ptr,  # STORE: int32, the token goes to store_ptr[slots[row]]
    slots_ptr,  # STORE: [B] int32
    BLOCK: tl.constexpr,
    GREEDY: tl.constexpr = False,  # the plain argmax: no noise (temperature_ptr unread)
    STORE: tl.constexpr = False,  # also store the token (one split only)
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    QUARTER: tl.constexpr = BLOCK // 4
    # At most 1e30: T * G stays finite (an inf temperature, which a request's 1e39 becomes
    # in float32, made +inf scores whose ties the lowest id won), and x + 1e30 * G already
    # drowns any logit, as x / T vanishes in the unfused draw: uniform over unmasked ids.
    temperature = 0.0
    if not GREEDY:
        temperature = tl.minimum(tl.load(temperature_ptr + row), 1e30)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    lane = tl.arange(0, QUARTER)
    best_val = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_idx = lo + lane  # a valid index even if every logit of the chunk is -inf
    for start in range(lo, hi, BLOCK):
        if GREEDY:
            r0, r1, r2, r3 = lane, lane, lane, lane  # unused
        else:
            counter = row * counters_per_row + start // 4 + lane
            r0, r1, r2, r3 = tl.randint4x(seed, counter)
        offs = start + lane
        score = _gumbel_score(row_logits, offs, hi, r0, temperature, GREEDY)
        best_val, best_idx = _keep_best(best_val, best_idx, score, offs)
        offs = start + QUARTER + lane
        score = _gumbel_score(row_logits, offs, hi, r1, temperature, GREEDY)
        best_val, best_idx = _keep_best(best_val, best_idx, score, offs)
        offs = start + 2 * QUARTER + lane
        score = _gumbel_score(row_logits, offs, hi, r2, temperature, GREEDY)
        best_val, best_idx = _keep_best(best_val, best_idx, score, offs)
        offs = start + 3 * QUARTER + lane
        score = _gumbel_score(row_logits, offs, hi, r3, temperature, GREEDY)
        best_val, best_idx = _keep_best(best_val, best_idx, score, offs)
    best, index = _lowest_argmax(best_val, best_idx)
    tl.store(part_val_ptr + row * num_splits + split, best)
    tl.store(part_idx_ptr + row * num_splits + split, index.to(tl.int64))
    if STORE:
        tl.store(store_ptr + tl.load(slots_ptr + row), index.to(tl.int32))


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_val_ptr,  # [B, S] float32
    part_idx_ptr,  # [B, S] int64
    out_ptr,  # [B] int64
    num_splits,
    store_ptr,  # STORE: int32, the token goes to store_ptr[slots[row]]
    slots_ptr,  # STORE: [B] int32
    BLOCK_S: tl.constexpr,
    STORE: tl.constexpr = False,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_splits
    values = tl.load(part_val_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    # Splits cover the vocabulary in order: a later split's index is always larger, so the
    # lowest index among equal maxima is also the lowest split's.
    indices = tl.load(part_idx_ptr + row * num_splits + offs, mask=mask, other=2147483647)
    _, index = _lowest_argmax(values, indices)
    tl.store(out_ptr + row, index)
    if STORE:
        tl.store(store_ptr + tl.load(slots_ptr + row), index.to(tl.int32))


def host_seed() -> int:
    """A fresh Philox key from torch's CPU default generator: no device sync, and
    ``torch.manual_seed`` makes the sequence of draws reproducible. 63-bit keys in
    [2^32, 2^63): Philox takes a 64-bit key, and a 31-bit one repeated a step's noise
    about 230 times in a million steps; keeping them above 2^32 passes every key to
    the kernel as int64, so it compiles once (Triton types an int argument by value)."""
    return int(torch.randint(2**32, 2**63 - 1, ()).item())


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(rows: int, vocab: int, device: torch.device, block: int) -> int:
    """Programs per row: enough in all to fill the GPU, at most one per block of V."""
    if device.type != "cuda":
        return 1
    target = PROGRAMS_PER_SM * _num_sms(device.index or 0)
    return max(1, min(triton.cdiv(vocab, block), triton.cdiv(target, rows)))


def greedy_argmax(logits: torch.Tensor, store: Store | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[B, V]`` logits on a GPU, the vocabulary split over
    programs as in ``fused_sample``; ties go to the lowest index, and unlike torch a NaN
    never wins. torch's argmax of one 128k-vocabulary row cost 28 us on the critical path
    of a Llama-3-8B decode step on an H200 (session 20's profile)."""
    return fused_sample(logits, None, 2**32, store=store)


def fused_sample(
    logits: torch.Tensor,  # [B, V] float, on the device
    temperature: torch.Tensor | None,  # [B] float32; 0 on greedy rows; None: all greedy
    seed: int,  # the Philox key (see host_seed)
    num_splits: int | None = None,  # programs per row; None = enough to fill the GPU
    block: int = DEFAULT_BLOCK,  # a power of two, at least 16
    store: Store | None = None,
) -> torch.Tensor:  # [B] int64
    """One token per row, drawn from ``softmax(logits / temperature)`` (the argmax on
    rows with temperature 0), in at most two launches; ``logits`` is not modified.
    ``store`` = ``(tokens, slots)``: also ``tokens[slots[row]] = id`` (int32), by the
    launch that finds the id (the executor's next-step inputs, without two more
    launches: a cast and an ``index_copy_``)."""
    rows, vocab = logits.shape
    greedy = temperature is None
    assert greedy or (temperature.shape == (rows,) and temperature.dtype == torch.float32)
    assert block >= 16 and block & (block - 1) == 0
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(vocab, block)
    counters_per_row = blocks * block // 4
    assert rows * counters_per_row < 2**31, "Philox counters are int32"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(rows, vocab, logits.device, block)
    blocks_per_split = triton.cdiv(blocks, max(1, min(num_splits, blocks)))
    num_splits = triton.cdiv(blocks, blocks_per_split)  # no empty split
    part_val = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    part_idx = (
        out.view(rows, 1) if num_splits == 1 else torch.empty_like(part_val, dtype=torch.int64)
    )
    if store is not None:
        tokens, slots = store
        assert tokens.dtype == slots.dtype == torch.int32 and slots.shape == (rows,)
    else:
        tokens = slots = out
    _gumbel_max_kernel[(rows, num_splits)](
        logits,
        logits if greedy else temperature,
        part_val,
        part_idx,
        logits.stride(0),
        vocab,
        blocks_per_split * block,
        counters_per_row,
        seed,
        tokens,
        slots,
        BLOCK=block,
        GREEDY=greedy,
        STORE=store is not None and num_splits == 1,
        num_warps=4 if block >= 512 else 1,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(rows,)](
            part_val,
            part_idx,
            out,
            num_splits,
            tokens,
            slots,
            # Sized by the vocabulary, not the split count (which follows the batch
            # size): one compile per model instead of one per split bracket mid-run.
            BLOCK_S=triton.next_power_of_2(blocks),
            STORE=store is not None,
            num_warps=1,
        )
    return out
