"""End-to-end scale tuning (plugins/quant/scale_tuning.py): on a tiny model rounded to
nearest, it lowers the whole model's next-token KL from the float model's (int4 group
scales; fp8 row scales, the activations rounded in the loop); it changes only the
scales (codes and zero points as they were), and the grids then hold exactly
the model's weights; ``tokenloom quantize --tune-scales`` writes such a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tokenloom.plugins.quant.int4 import dequantize_int4
from tokenloom.plugins.quant.scale_tuning import teacher_log_probs, tune_scales
from tokenloom.plugins.quant.signround import learn_layers


def _sequences(count: int = 8, length: int = 32) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, 200, (count, length), generator=gen).tolist()


def test_tuning_lowers_the_kl_and_changes_only_the_scales(tiny):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences()
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "int4", group=32, iters=0, batch=2)  # nearest
    codes = {n: g.codes.clone() for n, g in grids.items()}  # type: ignore[attr-defined]
    zeros = {n: torch.stack(g.zeros).clone() for n, g in grids.items()}  # type: ignore[attr-defined]
    scales = {n: torch.stack(g.scales).clone() for n, g in grids.items()}  # type: ignore[attr-defined]
    before, after = tune_scales(model, sequences, grids, teacher, steps=40, batch=2, lr=5e-3)
    assert after < 0.9 * before, (before, after)
    moved = 0
    for name, grid in grids.items():
        assert torch.equal(grid.codes, codes[name])  # type: ignore[attr-defined]
        assert torch.equal(torch.stack(grid.zeros), zeros[name])  # type: ignore[attr-defined]
        moved += int((torch.stack(grid.scales) != scales[name]).sum())  # type: ignore[attr-defined]
        qweight, s, z = grid.packed()  # type: ignore[attr-defined]
        assert torch.equal(s.float(), torch.stack(grid.scales))  # float16 values
        values = dequantize_int4(qweight, s, z, 32, torch.float32)
        assert torch.equal(values, model.get_submodule(name).weight.data)
    assert moved > 0


def test_fp8_row_scales_tuned_with_the_activations_rounded(tiny):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences()
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "fp8", iters=0, batch=2)  # nearest
    codes = {n: g.codes.clone() for n, g in grids.items()}  # type: ignore[attr-defined]
    before, after = tune_scales(model, sequences, grids, teacher, steps=40, batch=2, lr=5e-3)
    assert after < 0.9 * before, (before, after)
    for name, grid in grids.items():
        assert torch.equal(grid.codes, codes[name])  # type: ignore[attr-defined]
        values = grid.codes.float() * grid.scales  # type: ignore[attr-defined]
        assert torch.equal(values, model.get_submodule(name).weight.data)
    linear = next(iter(grids))
    assert not model.get_submodule(linear)._forward_pre_hooks  # the rounding hooks are gone


def test_tuning_refuses_a_teacher_of_other_packs(tiny):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences()
    teacher = teacher_log_probs(model, sequences, batch=4)
    grids = learn_layers(model, sequences, "int4", group=32, iters=0, batch=2)
    with pytest.raises(ValueError, match="same sequences"):
        tune_scales(model, sequences, grids, teacher, steps=1, batch=2)


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of ``run()``."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_the_tuned_projection_keeps_codes_not_a_float_weight(method):
    """A quantized Linear's product in the tuning: its output and its gradients (input,
    scales) equal autograd's through the float weight, while what it keeps for the
    backward pass is the input and the codes' bytes, not the 12 bytes a weight that the
    float weight and its product's factors take."""
    from tokenloom.plugins.quant.gptq import Fp8Grid, Int4Grid
    from tokenloom.plugins.quant.scale_tuning import _RowScales, _Scales

    n, k, group = 96, 200, 64  # k not a multiple of the group: a short last group
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen)
    grid = Int4Grid(group) if method == "int4" else Fp8Grid()
    grid.start(w)
    for column in range(k):
        if method == "int4" and column % group == 0:
            grid.fit(column, w[:, column : column + group])
        grid.round(w[:, column], column)
    scales = _Scales(grid) if method == "int4" else _RowScales(grid)
    with torch.no_grad():
        scales.t.copy_(0.05 * torch.randn(scales.t.shape, generator=gen))
    x = torch.randn(3, 5, k, generator=gen, requires_grad=True)
    probe = torch.randn(3, 5, n, generator=gen)

    def grads(project) -> tuple[torch.Tensor, ...]:
        x.grad = scales.t.grad = None
        y = project()
        (y * probe).sum().backward()
        return y.detach(), x.grad.clone(), scales.t.grad.clone()

    mine = grads(lambda: scales.project(x))
    reference = grads(lambda: torch.nn.functional.linear(x, scales()))
    for a, b in zip(mine, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert bool((mine[2] != 0).all())
    kept = _saved_bytes(lambda: scales.project(x))
    assert kept < x.numel() * 4 + n * k * 2, kept  # the input, a byte a code, the scales
    assert _saved_bytes(lambda: torch.nn.functional.linear(x, scales())) > n * k * 8


def test_the_tuned_kl_is_the_plain_models(tiny):
    """The KL that tune_scales reports after tuning, through its own projections, is
    the KL of the model's ordinary forward over the weights it wrote."""
    import torch.nn.functional as F

    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.signround import packed_context

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences(count=4)
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "int4", group=32, iters=0, batch=2)
    _, after = tune_scales(model, sequences, grids, teacher, steps=6, batch=2, lr=5e-3)
    assert "forward" not in vars(model.get_submodule(next(iter(grids))))  # put back
    ctx = packed_context(model, len(sequences[0]))
    plain = []
    with torch.no_grad():
        for i in range(0, len(sequences), 2):
            pack = sequences[i : i + 2]
            ids = torch.tensor([t for s in pack for t in s])
            pos = torch.arange(len(pack[0])).repeat(len(pack))
            logp = F.log_softmax(model.compute_logits(model(ids, pos, ctx)), dim=-1)
            target = teacher[i // 2].float()
            plain.append(float(F.kl_div(logp, target, log_target=True, reduction="batchmean")))
    assert after == pytest.approx(sum(plain) / len(plain), rel=1e-5)


def test_the_projections_are_put_back_when_the_tuning_fails(tiny):
    """A grid that names no module fails the tuning; the modules swapped before it get
    their class's forward back, and the rounding hooks are removed."""
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences(count=2)
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "fp8", iters=0, batch=2)
    names = list(grids)
    grids["model.layers.9.mlp.down_proj"] = grids[names[0]]  # no such layer
    with pytest.raises(AttributeError):
        tune_scales(model, sequences, grids, teacher, steps=1, batch=2)
    for name in names:
        linear = model.get_submodule(name)
        assert "forward" not in vars(linear) and not linear._forward_pre_hooks, name


def _assert_generates(checkpoint) -> None:
    """The written int4 checkpoint loads and greedily generates 8 tokens."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(checkpoint), dtype="float32", quant="int4")
    try:
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(outs[0].outputs[0].token_ids) == 8
    finally:
        llm.engine.shutdown()


def test_quantize_tune_scales_writes_the_tuned_checkpoint(tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main

    out = tmp_path / "tuned"
    args = ["--method", "int4", "--no-awq", "--rounding", "gptq", "--tune-scales", "8"]
    args += ["--batch", "2", "--no-tune-norms"]
    args += ["--out", str(out), "--calibration-tokens", "256", "--seq-len", "64"]
    assert main([str(tiny), *args, "--group-size", "32", "--threads", "1"]) == 0
    about = json.loads((out / "quantize.json").read_text())
    tuned = about["scale_tuning"]
    assert tuned["steps"] == 8 and not tuned["norms"] and tuned["kl_after"] < tuned["kl_before"]
    _assert_generates(out)


def test_quantize_tune_codes_writes_the_moved_codes(tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main

    out = tmp_path / "codes"
    args = ["--method", "int4", "--no-awq", "--iters", "4", "--tune-scales", "8"]
    args += ["--tune-codes", "0.02", "--batch", "2", "--group-size", "32"]
    args += ["--out", str(out), "--calibration-tokens", "256", "--seq-len", "64"]
    assert main([str(tiny), *args, "--threads", "1"]) == 0
    tuned = json.loads((out / "quantize.json").read_text())["scale_tuning"]
    assert tuned["codes"] == 0.02 and tuned["kl_after"] < tuned["kl_before"]
    plain = tmp_path / "plain"
    argv = [str(tiny), *args, "--threads", "1", "--tune-codes", "0", "--out", str(plain)]
    assert main(argv) == 0
    tensors = [load_file(d / "model.safetensors") for d in (out, plain)]
    qweights = [n for n in tensors[0] if n.endswith("qweight")]
    assert qweights and any(not torch.equal(tensors[0][n], tensors[1][n]) for n in qweights)
    _assert_generates(out)
    assert main([str(tiny), *args, "--threads", "1", "--tune-codes", "-1"]) == 2
    assert main([str(tiny), *args, "--threads", "1", "--rounding", "gptq"]) == 2
    assert main([str(tiny), *args, "--threads", "1", "--tune-scales", "0"]) == 2


def test_quantize_fp8_tunes_its_scales_by_default(tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main

    out = tmp_path / "fp8"
    args = ["--method", "fp8", "--out", str(out), "--calibration-tokens", "256"]
    assert main([str(tiny), *args, "--seq-len", "64", "--threads", "1"]) == 0
    about = json.loads((out / "quantize.json").read_text())
    assert about["method"] == "gptq fp8 + tuned scales" and about["scale_tuning"]["steps"] == 256
    assert about["scale_tuning"]["norms"]  # on by default
    assert about["scale_tuning"]["kl_after"] < about["scale_tuning"]["kl_before"]


def test_norm_gains_train_with_the_scales(tiny):
    from tokenloom.plugins.models.layers import RMSNorm
    from tokenloom.plugins.models.loader import load_model

    sequences = _sequences()
    after = {}
    for norms in (False, True):
        model, _ = load_model(tiny, torch.float32, "cpu")
        gains = {
            n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, RMSNorm)
        }
        teacher = teacher_log_probs(model, sequences, batch=2)
        grids = learn_layers(model, sequences, "int4", group=32, iters=0, batch=2)
        before, after[norms] = tune_scales(
            model, sequences, grids, teacher, steps=40, batch=2, lr=5e-3, norms=norms
        )
        moved = [not torch.equal(model.get_submodule(n).weight, w) for n, w in gains.items()]
        assert all(moved) if norms else not any(moved)
    assert after[True] < after[False] < before, (before, after)


def test_codes_train_with_the_scales_from_learned_rounding(tiny):
    """``codes=``: learned rounding's codes (``Int4Grid.latent``: round(w / s + v) + z)
    train with the scales end to end; the grids then hold the model's weights, and the KL
    ends below the scales-only tuning's from the same rounding."""
    from tokenloom.plugins.models.loader import load_model

    sequences = _sequences()
    after = {}
    for rate in (0.0, 0.02):
        model, _ = load_model(tiny, torch.float32, "cpu")
        teacher = teacher_log_probs(model, sequences, batch=2)
        grids = learn_layers(
            model, sequences, "int4", group=32, iters=20, batch=2, keep_latent=True
        )
        codes = {n: g.codes.clone() for n, g in grids.items()}  # type: ignore[attr-defined]
        before, after[rate] = tune_scales(
            model, sequences, grids, teacher, steps=40, batch=2, lr=5e-3, codes=rate
        )
        moved = 0
        for name, grid in grids.items():
            assert int(grid.codes.min()) >= 0 and int(grid.codes.max()) <= 15  # type: ignore[attr-defined]
            moved += int((grid.codes != codes[name]).sum())  # type: ignore[attr-defined]
            assert grid.latent is None  # type: ignore[attr-defined]  # spent, freed
            qweight, s, z = grid.packed()  # type: ignore[attr-defined]
            values = dequantize_int4(qweight, s, z, 32, torch.float32)
            assert torch.equal(values, model.get_submodule(name).weight.data)
        assert (moved > 0) == (rate > 0), moved
    assert after[0.02] < after[0.0] < before, (before, after)


def test_codes_stay_without_learned_rounding(tiny, caplog):
    from tokenloom.plugins.models.loader import load_model

    model, _ = load_model(tiny, torch.float32, "cpu")
    sequences = _sequences()
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "int4", group=32, iters=0, batch=2)  # no latent
    assert all(g.latent is None for g in grids.values())  # type: ignore[attr-defined]
    codes = {n: g.codes.clone() for n, g in grids.items()}  # type: ignore[attr-defined]
    tune_scales(model, sequences, grids, teacher, steps=4, batch=2, lr=5e-3, codes=0.02)
    assert all(torch.equal(g.codes, codes[n]) for n, g in grids.items())  # type: ignore[attr-defined]
    assert "no learned rounding to train the codes from" in caplog.text
