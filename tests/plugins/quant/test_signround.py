"""Learned rounding (plugins/quant/signround.py): with zero offsets it is round-to-nearest
on the int4 and fp8 grids; an offset only chooses between the two grid points around a
weight; the grids it returns hold what it computes; on a tiny model it lowers every
layer's output error below round-to-nearest's; ``tokenloom quantize --rounding learned``
writes a checkpoint that loads with the in-memory values and generates their tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.quant.awq import int4_rtn
from tokenloom.plugins.quant.fp8 import quantize_fp8_rows
from tokenloom.plugins.quant.int4 import dequantize_int4
from tokenloom.plugins.quant.signround import Fp8Rounding, Int4Rounding, learn_layers


def _weight(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [32, 64], ids=["whole-groups", "partial-group"])
def test_zero_offsets_round_to_nearest(group):
    w = _weight()
    assert torch.equal(Int4Rounding(w, group)(), int4_rtn(group)(w))
    xq, scales = quantize_fp8_rows(w)
    assert torch.equal(Fp8Rounding(w)(), xq.float() * scales)


def _random_offsets(rounder: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in rounder.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)  # then clamped
    rounder.clamp_()


def test_an_offset_chooses_one_of_the_two_grid_points_around_the_weight():
    w = _weight()
    fp8 = Fp8Rounding(w)
    _random_offsets(fp8)
    assert float(fp8.v.detach().abs().max()) <= 0.5
    moved = (fp8.codes() - fp8.unit).abs()
    assert bool((moved <= fp8.step * (1 + 1e-6)).all())
    assert bool((fp8.codes() != torch.round(fp8.unit / fp8.step) * fp8.step).any())
    int4 = Int4Rounding(w, 32)
    int4.v.data.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    codes, scale, zero = int4._grid()
    nearest = (torch.round(int4.w / scale) + zero).clamp(0, 15)
    assert int((codes - nearest).abs().max()) == 1


def test_the_grids_hold_the_rounded_values():
    w = _weight(k=80)  # a partial group of 16
    int4 = Int4Rounding(w, 32)
    _random_offsets(int4)
    assert float(int4.lo_clip.detach().min()) >= 0.5 and float(int4.hi_clip.detach().max()) <= 1.0
    qweight, scales, zeros = int4.grid().packed()
    values = dequantize_int4(qweight, scales, zeros, 32, torch.float32)
    assert values.shape == w.shape
    assert torch.equal(values, int4())
    fp8 = Fp8Rounding(w)
    _random_offsets(fp8)
    grid = fp8.grid()
    assert grid.codes is not None and grid.scales is not None
    assert torch.equal(grid.codes.float() * grid.scales, fp8())


def _sequences(count: int = 8, length: int = 32) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 200, (count, length), generator=gen).tolist()


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_learned_rounding_lowers_every_layers_output_error(method, tiny):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    record: dict[str, tuple[float, float]] = {}
    grids = learn_layers(model, _sequences(), method, group=32, iters=40, batch=2, record=record)
    assert len(record) == len(model.model.layers) and len(grids) == 4 * len(record)
    for layer, (nearest, learned) in record.items():
        assert learned < 0.9 * nearest, layer
    linear = model.model.layers[0].mlp.down_proj
    grid = grids["model.layers.0.mlp.down_proj"]
    if method == "int4":
        qweight, scales, zeros = grid.packed()  # type: ignore[attr-defined]
        values = dequantize_int4(qweight, scales, zeros, 32, torch.float32)
    else:
        values = grid.codes.float() * grid.scales  # type: ignore[attr-defined]
    assert torch.equal(values, linear.weight.data)  # the model holds the grid's values


def _log_probs(model, sequences) -> torch.Tensor:
    """``model``'s next-token log-probabilities at every position of ``sequences``."""
    from tokenloom.plugins.quant.signround import packed_context

    ids = torch.tensor([t for s in sequences for t in s])
    ctx = packed_context(model, len(sequences[0]))
    positions = torch.arange(len(sequences[0])).repeat(len(sequences))
    with torch.no_grad():
        return torch.log_softmax(model.compute_logits(model(ids, positions, ctx)), dim=-1)


@pytest.mark.parametrize("objective", ["head", "per-token"])
def test_learned_rounding_objectives_lower_their_own_error(objective, tiny):
    """``head``: the last layer fitted to the float model's next-token distribution
    (its recorded error is that KL); ``per-token``: relative errors. Each lowers its
    error in every layer, and the model's next-token KL from the float one ends below
    round-to-nearest's."""
    from tokenloom.plugins.models.loader import load_model

    sequences = _sequences()
    kls = {}
    for iters in (0, 40):
        model, _ = load_model(tiny, torch.float32, "cpu")
        reference = _log_probs(model, sequences)
        head = lambda x, model=model: model.compute_logits(model.model.norm(x))  # noqa: E731
        record: dict[str, tuple[float, float]] = {}
        learn_layers(
            model, sequences, "int4", group=32, iters=iters, batch=2, record=record,
            head=head if objective == "head" else None, per_token=objective == "per-token",
        )  # fmt: skip
        logp = _log_probs(model, sequences)
        kls[iters] = float(
            torch.nn.functional.kl_div(logp, reference, log_target=True, reduction="batchmean")
        )
        if iters:
            for layer, (nearest, learned) in record.items():
                assert learned < 0.9 * nearest, layer
    assert kls[40] < kls[0], kls  # the whole model's distributions: closer to float


def test_learned_rounding_refuses_sequences_of_different_lengths(tiny):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one length"):
        learn_layers(model, [[1, 2, 3], [4, 5]], "int4")


def test_quantize_learned_writes_a_checkpoint_that_loads_as_learned_in_memory(tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.calibration import sample_calibration_tokens

    out = tmp_path / "learned"
    args = ["--method", "int4", "--no-awq", "--iters", "10"]  # learned: int4's default
    args += ["--batch", "2", "--out", str(out), "--calibration-tokens", "256"]
    assert main([str(tiny), *args, "--seq-len", "64", "--group-size", "32", "--threads", "1"]) == 0
    about = json.loads((out / "quantize.json").read_text())
    assert about["method"] == "learned int4" and about["learned"]["iters"] == 10
    assert all(after < before for before, after in about["layer_errors"].values())
    # the same calibration again (seeded): the values the checkpoint must hold
    sequences = sample_calibration_tokens(str(tiny), 256, 64, 0)
    model, _ = load_model(tiny, torch.float32, "cpu")
    learn_layers(model, sequences, "int4", group=32, iters=10, batch=2)
    llm = LLM(str(out), dtype="float32", quant="int4")
    try:
        for name in ("mlp.gate_up_proj", "self_attn.qkv_proj"):
            k = llm.engine.executor.model.model.layers[1].get_submodule(name).kernel
            values = dequantize_int4(k.qweight, k.scales, k.zeros, 32, torch.float32)
            assert torch.equal(values, model.model.layers[1].get_submodule(name).weight.data)
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(outs[0].outputs[0].token_ids) == 8
    finally:
        llm.engine.shutdown()
