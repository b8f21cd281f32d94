"""``tokenloom quantize --device``: the calibrated pipeline (plugins/quant/calibrated.py)
runs on the model's device. On the CPU, every pass (AWQ, GPTQ, learned rounding, scale
tuning with norms and codes) runs a second time with the default device set to ``meta``:
a tensor made without naming a device is then a meta tensor, mixing it with the model's
raises, and the results must be the plain run's bit for bit. On a GPU (``gpu``), the
command with ``--device cuda`` writes a checkpoint that serves, its GPTQ rounding as far
from the float weights as the CPU run's on the same calibration sample."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from tokenloom.plugins.quant.awq import AwqScaler, int4_rtn
from tokenloom.plugins.quant.calibration import quantize_sequentially
from tokenloom.plugins.quant.gptq import Fp8Grid, Int4Grid
from tokenloom.plugins.quant.gptq_checkpoint import checkpoint_tensors
from tokenloom.plugins.quant.scale_tuning import teacher_log_probs, tune_scales
from tokenloom.plugins.quant.signround import learn_layers

F32 = torch.float32


def _sequences(count: int = 4, length: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 200, (count, length), generator=gen).tolist()


def _every_pass(tiny, device: str, default: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of three quantized checkpoints of ``tiny`` (int4 AWQ + learned rounding
    + scale, norm and code tuning; int4 AWQ + GPTQ, act-order; fp8 GPTQ + tuning), the
    models loaded on ``device``, the passes run with ``default`` as the default device."""
    from tokenloom.plugins.models.loader import load_model

    sequences = _sequences()
    models = [load_model(tiny, torch.float32, device)[0] for _ in range(3)]
    out: dict[str, torch.Tensor] = {}
    with torch.device(default) if default else contextlib.nullcontext():
        model = models[0]
        teacher = teacher_log_probs(model, sequences, batch=2)
        grids = learn_layers(
            model, sequences, "int4", group=32, iters=4, batch=2,
            prepare_layer=AwqScaler(int4_rtn(32)), keep_latent=True,
        )  # fmt: skip
        tune_scales(model, sequences, grids, teacher, steps=3, batch=2, norms=True, codes=0.01)
        out.update({f"learned.{k}": v for k, v in checkpoint_tensors(model, grids, F32).items()})
        ct = checkpoint_tensors(model, grids, F32, "compressed-tensors")
        out.update({f"learned-ct.{k}": v for k, v in ct.items()})

        model = models[1]
        grids = quantize_sequentially(
            model, sequences, lambda: Int4Grid(32, static=True), act_order=True,
            prepare_layer=AwqScaler(int4_rtn(32)),
        )  # fmt: skip
        out.update({f"gptq.{k}": v for k, v in checkpoint_tensors(model, grids, F32).items()})

        model = models[2]
        grids = quantize_sequentially(model, sequences, Fp8Grid)
        teacher = teacher_log_probs(model, sequences, 2)
        tune_scales(model, sequences, grids, teacher, steps=2, batch=2)
        out.update({f"fp8.{k}": v for k, v in checkpoint_tensors(model, grids, F32).items()})
    return out


class _HostStepAdam(torch.optim.Adam):
    """Adam whose step runs with the CPU as the default device: torch 2.11's Adam makes
    its step counter without naming a device (a host scalar by design; torch 2.13's
    names it), which the meta default device would turn into a meta tensor."""

    def step(self, closure=None):  # type: ignore[override]
        with torch.device("cpu"):
            return super().step(closure)


def test_every_pass_makes_its_tensors_on_the_models_device(tiny, monkeypatch):
    plain = _every_pass(tiny, "cpu")
    monkeypatch.setattr(torch.optim, "Adam", _HostStepAdam)
    strict = _every_pass(tiny, "cpu", default="meta")  # tensors made without a device: meta
    assert plain.keys() == strict.keys()
    assert any(k.endswith(".qweight") for k in plain)
    assert any(k.endswith("weight_scale") for k in plain)
    assert any(k.endswith(".weight_zero_point") for k in plain)
    for key, tensor in plain.items():
        assert strict[key].device.type == "cpu", key
        assert torch.equal(strict[key], tensor), key


def test_a_device_that_is_not_there_is_refused(tiny, tmp_path, capsys):
    from tokenloom.entrypoints.quantize import main

    args = [str(tiny), "--method", "int4", "--out", str(tmp_path / "q"), "--device"]
    with pytest.raises(SystemExit):  # argparse's choices
        main([*args, "tpu"])
    assert "--device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args, "cuda"]) == 2
        assert "--device cuda: no GPU" in capsys.readouterr().err


def test_the_default_device_is_a_gpu_where_there_is_one(tiny, tmp_path, monkeypatch):
    from tokenloom.entrypoints.quantize import main
    from tokenloom.plugins.quant import calibration

    args = ["--method", "fp8", "--rounding", "gptq", "--tune-scales", "0", "--threads", "1"]
    args += ["--calibration-tokens", "128", "--seq-len", "64", "--out", str(tmp_path / "q")]
    assert main([str(tiny), *args]) == 0  # no --device, and here no GPU: the CPU
    about = json.loads((tmp_path / "q" / "quantize.json").read_text())
    assert about["device"] == ("cuda" if torch.cuda.is_available() else "cpu")

    chosen = []

    def sample(*args, **kwargs):  # the device the sampling is asked to run on, then stop
        chosen.append(args[-1])
        raise ValueError("stop here")

    monkeypatch.setattr(calibration, "sample_calibration_tokens", sample)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if there were one
    assert main([str(tiny), *args]) == 2
    assert main([str(tiny), *args, "--device", "cpu"]) == 2
    assert chosen == ["cuda", "cpu"]


def test_a_calibration_cache_of_other_settings_is_a_one_line_error(tiny, tmp_path, capsys):
    from tokenloom.entrypoints.quantize import main

    cache = tmp_path / "sample.json"
    cache.write_text(json.dumps({"model": "elsewhere", "seq_len": 64, "seed": 0, "sequences": []}))
    args = ["--method", "fp8", "--out", str(tmp_path / "q"), "--seq-len", "64"]
    assert main([str(tiny), *args, "--calibration-cache", str(cache), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: calibration cache") and "model differ" in err
    assert "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_quantize_on_cuda_rounds_as_the_cpu_does_and_it_serves(tiny_model_factory, tmp_path):
    from tokenloom import LLM, SamplingParams
    from tokenloom.entrypoints.quantize import main

    shape = {"hidden_size": 1024, "intermediate_size": 2048, "num_heads": 8, "num_kv_heads": 2}
    tiny = tiny_model_factory("llama", **shape)  # shapes the GPU's int4 kernels take
    cache = tmp_path / "sample.json"  # one calibration sample for both devices
    common = ["--calibration-tokens", "256", "--seq-len", "64", "--group-size", "128"]
    common += ["--threads", "2"]
    for device in ("cpu", "cuda"):  # GPTQ alone: AWQ's choice of scale is discrete
        args = ["--method", "int4", "--rounding", "gptq", "--tune-scales", "0", "--no-awq"]
        args += [*common, "--calibration-cache", str(cache), "--out", str(tmp_path / device)]
        assert main([str(tiny), *args, "--device", device]) == 0
    cpu, gpu = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("cpu", "cuda"))
    assert cpu.keys() == gpu.keys()
    # GPTQ is chaotic: a relative 1e-6 change of the weights leaves 18-47% of the packed
    # words of this model equal (measured on the CPU), so the codes are not compared.
    # Each projection's weight error is: on the CPU the same change moves it by 0.4%
    # at most; a GPTQ that went wrong (its Hessian, its order) lands elsewhere.
    source = load_file(str(tiny / "model.safetensors"))
    errors = {d: _weight_errors(ckpt, source) for d, ckpt in (("cpu", cpu), ("cuda", gpu))}
    assert len(errors["cpu"]) == 14
    for key, expected in errors["cpu"].items():
        assert abs(errors["cuda"][key] / expected - 1) < 0.02, (key, errors["cuda"][key], expected)
    about = json.loads((tmp_path / "cuda" / "quantize.json").read_text())
    assert about["device"] == "cuda"

    # the default recipe's steps on the GPU (AWQ, learned rounding, then scale tuning),
    # its calibration text sampled there
    out = tmp_path / "learned"
    args = ["--method", "int4", "--iters", "16", "--tune-scales", "8"]
    assert main([str(tiny), *args, *common, "--out", str(out), "--device", "cuda"]) == 0
    tuned = json.loads((out / "quantize.json").read_text())["scale_tuning"]
    assert tuned["kl_after"] < tuned["kl_before"]
    llm = LLM(str(out), dtype="bfloat16")
    try:
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(outs[0].outputs[0].token_ids) == 8
    finally:
        llm.engine.shutdown()


def _weight_errors(ckpt: dict[str, torch.Tensor], source: dict[str, torch.Tensor]):
    """Each GPTQ projection's ``|Q - W| / |W|`` (Frobenius) against the source weight."""
    from tokenloom.plugins.quant.int4 import dequantize_int4
    from tokenloom.plugins.quant.int4_checkpoints import unpack_columns

    errors = {}
    for key in ckpt:
        if key.endswith(".qweight"):
            p = key.removesuffix(".qweight")
            zeros = unpack_columns(ckpt[f"{p}.qzeros"], tuple(range(8))) + 1  # stored z - 1
            q = dequantize_int4(ckpt[key], ckpt[f"{p}.scales"], zeros, 128, F32)
            w = source[f"{p}.weight"].float()
            errors[p] = float((q - w).norm() / w.norm())
    return errors


def _layer_grads(tiny, device: str) -> dict[str, torch.Tensor | None]:
    """The gradients of every parameter of decoder layer 1 (norms included) of a
    squared-output loss, the layer run as learned rounding runs it (grad recorded)."""
    from torch.func import functional_call

    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.signround import packed_context

    model, _ = load_model(tiny, torch.float32, device)
    inner, length = model.model, 24
    ids = torch.tensor([t for s in _sequences(2, length) for t in s], device=device)
    rope = inner.rotary(torch.arange(length, device=device).repeat(2))
    hidden = inner.embed_tokens(ids).float()
    layer = inner.layers[1]
    weights = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    h, r = functional_call(
        layer, weights, (rope, hidden, 0.5 * hidden, packed_context(model, length))
    )
    (h + r).square().mean().backward()
    return {n: w.grad for n, w in weights.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_layer_on_cuda_records_the_gradients_the_cpu_records(tiny):
    # the fused Triton norm, SiLU-and-mul and rope write outputs autograd does not see:
    # with gradients recorded, a GPU layer must take the reference ops
    cpu, gpu = _layer_grads(tiny, "cpu"), _layer_grads(tiny, "cuda")
    assert cpu.keys() == gpu.keys() and any("norm" in n for n in cpu)
    for name, expected in cpu.items():
        got = gpu[name]
        assert expected is not None and got is not None, name
        scale = float(expected.abs().max())
        assert float((got.cpu() - expected).abs().max()) <= 1e-3 * scale, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_tuning_on_cuda_takes_less_than_the_float_weights(tiny_model_factory):
    # what the scale tuning adds on the GPU above the loaded model and its codes: each
    # projection keeps its input and codes for the backward pass, not a float weight
    # (which, with its product's factors and the float codes and zero points the
    # tuning used to copy, took about 20 bytes a quantized weight)
    from tokenloom.plugins.models.loader import load_model

    shape = {"hidden_size": 1024, "intermediate_size": 4096, "num_heads": 8}
    tiny = tiny_model_factory("llama", num_layers=6, num_kv_heads=2, **shape)
    model, _ = load_model(tiny, torch.float32, "cuda")
    sequences = _sequences(4, 64)
    teacher = teacher_log_probs(model, sequences, batch=2)
    grids = learn_layers(model, sequences, "int4", group=128, iters=0, batch=2)  # nearest
    weights = sum(model.get_submodule(n).weight.numel() for n in grids)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    before, after = tune_scales(model, sequences, grids, teacher, steps=4, batch=2, norms=True)
    extra = torch.cuda.max_memory_allocated() - base
    assert after < before
    assert extra < 4 * weights, (extra / weights, weights)
