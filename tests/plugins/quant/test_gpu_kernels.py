"""On the GPU: the fp8 path (fused per-token quantization, ``torch._scaled_mm``) and
the measured tiling choice of the weight GEMM agree with the reference paths, on
Llama-3-8B shapes; and a bf16 engine runs end to end with each method.
(The Triton interpreter's fp8 casts are not faithful, so these run on CUDA only.)"""

from __future__ import annotations

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.plugins.models.layers import Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _layer(n: int, k: int) -> Linear:
    torch.manual_seed(0)
    layer = Linear(k, (n,), False, torch.bfloat16).cuda()
    torch.nn.init.normal_(layer.weight, std=k**-0.5)
    return layer


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("k", [4096, 14336])
@pytest.mark.parametrize("one_pass", [False, True])
def test_fused_per_token_fp8_equals_the_torch_reference(m, k, one_pass):
    from tokenloom.plugins.quant.fp8 import quantize_fp8_rows
    from tokenloom.plugins.quant.kernels.fp8_quant import per_token_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x[:, 7] *= 50  # an outlier channel
    q, s = per_token_fp8(x, one_pass=one_pass)
    q_ref, s_ref = quantize_fp8_rows(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 tensor cores need compute capability 8.9+",
)
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_fp8_scaled_mm_equals_the_reference(m, n, k):
    from tokenloom.plugins.quant.fp8 import Fp8Quant

    layer = _layer(n, k)
    kernel = Fp8Quant(EngineConfig()).make_kernel(layer)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = kernel.apply(x, None).float()
    ref = kernel.reference(x, None).float()
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 5, 16, 40, 300, 2048])
def test_chosen_tilings_equal_the_reference(method, m):
    from tokenloom.plugins.quant.int4 import Int4Quant
    from tokenloom.plugins.quant.int8 import Int8Quant

    layer = _layer(4096, 14336)
    kernel = (Int8Quant if method == "int8" else Int4Quant)(EngineConfig()).make_kernel(layer)
    from tokenloom.plugins.quant.kernels.dispatch import BUCKETS

    assert kernel.configs is not None and len(kernel.configs) == len(BUCKETS)
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    got = kernel.apply(x, bias).float()
    ref = kernel.reference(x, bias).float()
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("quant", ["fp8", "int8", "int4"])
def test_engine_generates_with_each_method_on_the_gpu(quant, tiny_model_factory):
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", device="cuda", quant=quant)
    try:
        outs = llm.generate(
            [[5, 6, 7, 8], [9, 10]],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]
        layer = llm.engine.executor.model.model.layers[0].mlp.down_proj
        assert layer.kernel is not None and layer.weight.numel() == 0
    finally:
        llm.engine.shutdown()
