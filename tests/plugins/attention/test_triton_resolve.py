"""``triton_settings.resolve``: what the Triton backend launches with on CUDA (and under
the interpreter), checked on the CPU. The backend's GPU tests check the same tables
through a live backend; these run in CI, where no CUDA default would otherwise be read."""

from __future__ import annotations

import pytest

from tokenloom.plugins.attention.triton_settings import (
    FP8_PREFILL,
    INTERPRETER_DEFAULTS,
    MMA_DECODE,
    QUANT_DECODE,
    cuda_defaults,
    resolve,
)

LLAMA = dict(head_dim=128, group=4, block_size=64, fp32_queries=False)


def cuda(settings=None, *, pdl=True, **shape):
    return resolve(settings or {}, **{**LLAMA, **shape}, interpreted=False, pdl=pdl)


def test_llama_on_cuda_takes_every_measured_table():
    r = cuda()
    defaults = cuda_defaults(128)
    assert r.decode_fp8_mma and r.decode_kv_asm and r.mma_decode_fold
    assert (r.mma_decode_block_n, r.mma_decode_num_stages, r.mma_decode_maxnreg) == (
        MMA_DECODE["decode_block_n"],
        MMA_DECODE["decode_num_stages"],
        MMA_DECODE["decode_maxnreg"],
    )
    assert r.mma_decode_meta_ahead
    assert (r.quant_decode_num_stages, r.quant_decode_maxnreg) == tuple(QUANT_DECODE.values())
    assert (r.decode_num_stages, r.decode_maxnreg) == (
        defaults["decode_num_stages"],
        defaults["decode_maxnreg"],
    )  # the 16-bit decode keeps the plain table
    plain = {key: defaults[key] for key in FP8_PREFILL}
    assert r.prefill_tiles == {False: plain, True: FP8_PREFILL}
    assert r.prefill_meta_ahead and r.prefill_kv_f16
    assert not r.prefill_fp8_mma and not r.prefill_fresh_16bit  # opt-in
    assert r.decode_prefetch_max_batch == defaults["decode_prefetch_max_batch"]


def test_without_pdl_the_prefetch_is_off_unless_the_user_set_it():
    assert cuda(pdl=False).decode_prefetch_max_batch == 0
    assert cuda({"decode_prefetch_max_batch": 3}, pdl=False).decode_prefetch_max_batch == 3


@pytest.mark.parametrize("shape", [dict(head_dim=256), dict(fp32_queries=True)])
def test_the_measured_tables_stay_where_they_were_measured(shape):
    # head_dim above 128 or fp32 queries: the plain settings for every kernel, no fold
    r = cuda(**shape)
    defaults = cuda_defaults(shape.get("head_dim", 128))
    assert (r.quant_decode_num_stages, r.quant_decode_maxnreg) == (
        defaults["decode_num_stages"],
        defaults["decode_maxnreg"],
    )
    assert (r.mma_decode_block_n, r.mma_decode_maxnreg, r.mma_decode_fold) == (0, 0, False)
    assert r.prefill_tiles[True] == r.prefill_tiles[False]


def test_a_user_key_of_a_table_keeps_that_table_off():
    r = cuda({"decode_maxnreg": 96})
    assert r.quant_decode_maxnreg == 96 and r.mma_decode_maxnreg == 96
    assert r.mma_decode_block_n == 0  # the decode's own block, chosen per batch
    chosen = cuda({"prefill_num_warps": 8})
    assert chosen.prefill_tiles[True] == chosen.prefill_tiles[False]
    assert chosen.prefill_tiles[True]["prefill_num_warps"] == 8
    assert cuda({"decode_fp8_fold": 0}).mma_decode_fold is False


@pytest.mark.parametrize(
    "shape",
    [dict(head_dim=16), dict(head_dim=96), dict(group=32), dict(block_size=8)],
)
def test_the_fp8_mma_decode_is_off_with_a_warning_where_the_shape_forbids_it(shape, caplog):
    assert cuda(**shape).decode_fp8_mma is False  # quietly: it was the default
    with caplog.at_level("WARNING", logger="tokenloom.attention"):
        r = cuda({"decode_fp8_mma": 1, "prefill_fp8_mma": 1}, **shape)
    assert r.decode_fp8_mma is False and r.prefill_fp8_mma is False
    assert "decode_fp8_mma: off" in caplog.text and "prefill_fp8_mma: off" in caplog.text


def test_the_fp8_mma_prefill_applies_as_asked_where_it_can():
    assert cuda({"prefill_fp8_mma": 1}).prefill_fp8_mma is True
    assert cuda({"prefill_fp8_mma": 1}, fp32_queries=True).prefill_fp8_mma is False
    narrow = cuda({"prefill_fp8_mma": 1, "prefill_block_n": 16})  # fp8 dots need K >= 32
    assert narrow.prefill_fp8_mma is False


def test_the_interpreter_takes_its_tiny_tiles_and_runs_no_ptx():
    r = resolve({"decode_kv_asm": 1}, **LLAMA, interpreted=True, pdl=False)
    assert r.decode_kv_asm is False
    assert r.decode_block_n == INTERPRETER_DEFAULTS["decode_block_n"]
    assert r.decode_fp8_mma is False and r.mma_decode_fold is False
    assert r.prefill_tiles[True] == r.prefill_tiles[False]


@pytest.mark.parametrize("settings", [{"block_q": 8}, {"prefill_meta_ahead": 2}])
def test_unknown_keys_and_values_are_refused(settings):
    with pytest.raises(ValueError):
        cuda(settings)
