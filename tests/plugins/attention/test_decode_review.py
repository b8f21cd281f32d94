"""Review of the 8-bit-cache decode conversion (29479e4): two defects a CPU run showed,
fixed since (the query rows are shrunk into f16's range, the scores undo it; the
interpreter never takes the PTX path).

- The decode kernel casts a 16-bit query to f16 before the first dot (``KV_F16``). A bf16
  query element above f16's largest value (65,504) became inf and the output NaN, where
  the bf16-operand path before the change, and the torch reference, stay finite.
- ``decode_kv_asm = 1`` under the interpreter reached the PTX helpers for an int8
  cache, which the interpreter cannot run.
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_batch, model_info, relative_error
from test_kv_quant import quantized_copy

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention, is_interpreted

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def decode_over_int8(dtype: torch.dtype, big: float | None = None, **settings):
    """(Triton output, torch reference) of two decodes over an int8 cache; ``big``
    replaces one query element of the first request."""
    batch = make_batch([1, 1], [40, 17], dtype=dtype, device=DEVICE)
    if big is not None:
        batch.q[0, 0, 0] = big
    info = model_info(4, 2, 32, dtype, DEVICE)
    caches = quantized_copy(batch, torch.int8)
    ref_caches = quantized_copy(batch, torch.int8)
    write_kv_cache(batch.k, batch.v, *caches, batch.meta.slot_mapping)
    attn = TritonAttention(EngineConfig(), info, max_num_splits=4, **settings)
    attn.prepare(batch.meta)
    out = attn.forward(batch.q, batch.k, batch.v, *caches, batch.meta, batch.scale, kv_written=True)
    ref = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, *ref_caches, batch.meta, batch.scale
    )
    return out, ref


def test_bf16_query_beyond_the_f16_range_gives_a_finite_output():
    out, ref = decode_over_int8(torch.bfloat16, big=70_000.0)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all()
    assert relative_error(out, ref.double().cpu()) < 2e-2


@pytest.mark.skipif(not is_interpreted(), reason="the interpreter's handling of decode_kv_asm")
def test_interpreter_ignores_decode_kv_asm_for_an_int8_cache_as_for_fp8():
    out, ref = decode_over_int8(torch.float16, decode_kv_asm=1)
    assert relative_error(out, ref.double().cpu()) < 3e-3


def test_an_fp8_cache_is_refused_before_any_kernel_on_a_gpu_below_sm89():
    """Triton cannot read e4m3 below sm_89: the backend says so (and what to use) before
    the KV write, instead of Triton's compile error. Stands in for such a GPU by the
    flag the constructor sets from the device's capability."""
    batch = make_batch([1, 3], [40, 17], dtype=torch.float16, device=DEVICE)
    caches = quantized_copy(batch, torch.float8_e4m3fn)
    attn = TritonAttention(EngineConfig(), model_info(4, 2, 32, torch.float16, DEVICE))
    attn._fp8_ok = False
    attn.prepare(batch.meta)
    before = [c.view(torch.uint8).clone() for c in caches]
    with pytest.raises(RuntimeError, match="kv_cache_dtype = 'int8'"):
        attn.forward(batch.q, batch.k, batch.v, *caches, batch.meta, batch.scale)
    assert all(torch.equal(c.view(torch.uint8), b) for c, b in zip(caches, before, strict=True))
