"""``tokenloom quantize --format compressed-tensors``: the same calibrated codes and
scales as the default GPTQ / fbgemm_fp8 checkpoint, in llm-compressor's format. The
engine reads it back as that method (``quant`` left at none), every quantized layer
computes exactly what its twin's computes, and the two generate the same tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tokenloom import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42]]


def _outputs(path, x_seed: int = 0) -> tuple[str, dict[str, torch.Tensor], list[list[int]]]:
    """The method the engine chose, every quantized layer's product of a random input,
    and the greedy tokens of ``PROMPTS``."""
    llm = LLM(str(path), dtype="float32")
    try:
        model = llm.engine.executor.model
        gen = torch.Generator().manual_seed(x_seed)
        products = {}
        for name, module in model.named_modules():
            kernel = getattr(module, "kernel", None)
            if kernel is not None:
                x = torch.randn(3, module.in_features, generator=gen)
                products[name] = kernel.apply(x, None).cpu()
        params = SamplingParams(temperature=0.0, max_tokens=12)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return llm.engine.config.quant, products, [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_compressed_tensors_output_serves_as_its_gptq_twin(method, tiny, tmp_path):
    from tokenloom.entrypoints.quantize import main

    cache = tmp_path / "sample.json"  # one calibration sample for both
    for fmt in ("gptq", "compressed-tensors"):
        args = ["--method", method, "--rounding", "gptq", "--tune-scales", "0"]
        args += ["--calibration-tokens", "256", "--seq-len", "64", "--group-size", "32"]
        args += ["--threads", "1", "--calibration-cache", str(cache)]
        args += ["--no-awq"] if method == "int4" else []
        assert main([str(tiny), *args, "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    ct = tmp_path / "compressed-tensors"
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == ("pack-quantized" if method == "int4" else "float-quantized")
    keys = load_file(str(ct / "model.safetensors")).keys()
    suffix = ".weight_packed" if method == "int4" else ".weight_scale"
    assert sum(k.endswith(suffix) for k in keys) == 7 * 2  # every projection of 2 layers
    assert not any(k.endswith((".qweight", ".g_idx")) for k in keys)

    twin_method, twin_products, twin_tokens = _outputs(tmp_path / "gptq")
    ct_method, ct_products, ct_tokens = _outputs(ct)
    assert twin_method == ct_method == method
    assert twin_products.keys() == ct_products.keys() and len(ct_products) == 4 * 2
    for name, product in ct_products.items():
        assert torch.equal(product, twin_products[name]), name
    assert ct_tokens == twin_tokens and all(len(t) == 12 for t in ct_tokens)
