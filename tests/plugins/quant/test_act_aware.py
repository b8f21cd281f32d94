"""Activation-aware, asymmetric GPTQ for fp8 (``plugins/quant/act_aware.py``): the inputs
are rounded as the W8A8 reference path rounds them, the target weight is the float
weight where the streams agree, GPTQ of it leaves less of the asymmetric error than GPTQ
of the float weight, and ``tokenloom quantize --act-aware`` writes a loadable checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.quant.act_aware import fp8_activations, rounded_inputs, target_weight
from tokenloom.plugins.quant.fp8 import Fp8Kernel, quantize_fp8_rows
from tokenloom.plugins.quant.gptq import Fp8Grid, gptq


def _inputs(seed: int = 0, tokens: int = 2048, k: int = 96):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5
    x = torch.randn(tokens, k, generator=gen) @ mix
    x[:, :3] *= 20.0  # a few large channels: the small ones lose most to per-token e4m3
    return x


def test_the_rounding_is_the_reference_kernel_s() -> None:
    x = _inputs()[:16]
    w = torch.randn(32, x.shape[1])
    q, scales = quantize_fp8_rows(w)
    kernel = Fp8Kernel(q, scales)
    expected = F.linear(fp8_activations(x), q.float() * scales)
    assert torch.allclose(kernel.reference(x, None), expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fp8_activations(x), x)


def test_rounded_inputs_reach_every_linear_of_the_layer_meanwhile() -> None:
    from tokenloom.plugins.models.layers import Linear

    layer = Linear(8, (4,), False, torch.float32, "column")
    layer.weight.data = torch.randn(4, 8)
    block = torch.nn.Sequential(layer)
    x = _inputs(k=8)[:5]
    with rounded_inputs(block, fp8_activations):
        inside = block(x)
    assert torch.allclose(inside, F.linear(fp8_activations(x), layer.weight), atol=1e-6)
    assert torch.allclose(block(x), F.linear(x, layer.weight), atol=1e-6)  # hooks gone


def test_the_target_is_the_weight_itself_where_the_streams_agree() -> None:
    x = _inputs()
    h = x.t().double() @ x.double()
    w = torch.randn(16, x.shape[1])
    assert torch.equal(target_weight(w, h, h.clone(), 0.01), w)


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_of_the_target_leaves_less_asymmetric_error(seed) -> None:
    x_fp = _inputs(seed)
    # the quantized stream: rounded per token, and a systematic distortion from the rounded
    # layers before (a channel mix the float model does not have)
    gen = torch.Generator().manual_seed(seed + 10)
    drift = torch.eye(x_fp.shape[1]) + 0.02 * torch.randn(
        x_fp.shape[1], x_fp.shape[1], generator=gen
    )
    x_q = fp8_activations(x_fp @ drift)
    w = 0.05 * torch.randn(48, x_fp.shape[1], generator=gen)
    h = x_q.t().double() @ x_q.double()
    c = x_q.t().double() @ x_fp.double()

    def error(q: torch.Tensor) -> float:
        return float((x_fp @ w.t() - x_q @ q.t()).pow(2).sum())

    plain = gptq(w, h, Fp8Grid())
    aware = gptq(target_weight(w, h, c, 0.01), h, Fp8Grid())
    assert error(aware) < 0.7 * error(plain)


def test_quantize_act_aware_writes_a_checkpoint_that_loads(tiny_model_factory, tmp_path) -> None:
    from tokenloom.entrypoints.quantize import main

    tiny = str(tiny_model_factory("llama"))
    out = tmp_path / "fp8"
    args = ["--method", "fp8", "--act-aware", "--out", str(out), "--calibration-tokens", "128"]
    assert main([tiny, *args, "--seq-len", "64", "--threads", "1"]) == 0
    about = json.loads((out / "quantize.json").read_text())
    assert about["method"] == "act-aware gptq fp8"
    assert main([tiny, "--method", "int4", "--act-aware", "--out", str(tmp_path / "x")]) == 2
    llm = LLM(str(out), dtype="float32", quant="fp8")
    try:
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(outs[0].outputs[0].token_ids) == 8
    finally:
        llm.engine.shutdown()
