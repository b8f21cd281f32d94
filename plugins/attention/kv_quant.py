"""Quantized KV cache (``kv_cache_dtype`` fp8 | int8): the pool layout and the
reference quantize / dequantize.

Scales are dynamic, one per token and KV head (absmax of the head's ``head_dim``
values over the format's largest value: 448 for fp8 e4m3, 127 for int8), computed
when the token is written. They need no calibration, a row never shares its range
with an outlier elsewhere, and a block filled one token at a time never has to be
re-quantized. The cost is 4 bytes per token and head next to ``head_dim`` bytes.
(fp8 scales rounded up to a power of two were measured too: they move each token's
logprob more, see docs/quantization.md.)

Each block of a quantized pool holds its data, then its scales:
``[block_size, num_kv_heads, head_dim]`` of fp8/int8 followed by
``[num_kv_heads, block_size]`` fp32 (the block padded to 16 bytes). The scales are
head-major (built in session 53, landed in 55; token-major before) so that a kernel
reading one KV head's tokens reads its scales contiguously: a tile's scales are whole
sectors, and vector loads where Triton is told of the runs, rather than one 4-byte scale
out of each 32-byte sector of eight heads. The cache a layer sees is the data view
``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided: one block every
``block_bytes``); ``scales_of(cache)`` gives the scale view of the same memory, so the
caches still travel as plain tensors through the model, CUDA graphs and the attention
interface. Unquantized pools are allocated exactly as before.

An fp8 pool may store each block's **values transposed**, ``[num_kv_heads, head_dim,
block_size]`` (``allocate(..., v_transposed=True)``, asked by the attention backend's
``fp8_values_transposed``): the view keeps its shape, with the strides of that order
(token stride 1). The fp8 decode kernel ``triton_kernels/decode_fp8_mma.py`` multiplies
V^T by the probabilities on the tensor cores, which takes V^T's tokens contiguous; the
other readers and writers follow the view's strides (``v_transposed(cache)``).
"""

from __future__ import annotations

import torch

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The scale is ``absmax * (1 / QMAX)``, the reciprocal rounded once to fp32, and the
# kernels (``triton_kernels.kv_write``) compute exactly that. A division by the Python
# scalar would not be one formula: torch on CUDA turns ``t / 127.0`` into this very
# multiplication while the CPU divides, and Triton's ``/`` is approximate. The values
# are then ``x / scale``, an IEEE division here (tensor by tensor) and ``div_rn`` there,
# so the cache is bit-equal whichever wrote it (an ulp off the scale moves values lying
# near a rounding tie by one int8 step).
INV_QMAX = {dtype: 1.0 / qmax for dtype, qmax in QMAX.items()}
SCALE_BYTES = 4  # fp32, one per token and KV head
V_TRANSPOSABLE = {torch.float8_e4m3fn}  # pools whose value blocks may be [heads, D, tokens]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def cache_dtype(kv_cache_dtype: str, model_kv_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype: ``auto`` keeps ``model_kv_dtype`` (the model's, or what the
    weight quant method asks for); fp8 / int8 quantize, whatever the weights are."""
    if kv_cache_dtype == "auto":
        return model_kv_dtype
    return KV_DTYPES[kv_cache_dtype]


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer's keys (or values), scales included."""
    data = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    if not is_quantized(dtype):
        return data
    return -(-(data + block_size * num_kv_heads * SCALE_BYTES) // 16) * 16


def allocate(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    v_transposed: bool = False,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The zeroed pool (one tensor) and each layer's ``(k_cache, v_cache)`` views;
    ``v_transposed``: an fp8 pool's value blocks stored ``[heads, D, tokens]``."""
    if not is_quantized(dtype):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return pool, [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
    per_block = block_bytes(block_size, num_kv_heads, head_dim, dtype)
    pool = torch.zeros((num_layers, 2, num_blocks, per_block), dtype=torch.uint8, device=device)
    data = block_size * num_kv_heads * head_dim
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def view(flat: torch.Tensor) -> torch.Tensor:  # [num_blocks, per_block] uint8
        return flat[:, :data].unflatten(1, shape[1:]).view(dtype)

    def transposed_view(flat: torch.Tensor) -> torch.Tensor:  # the same, [heads, D, tokens]
        blocks = flat[:, :data].unflatten(1, (num_kv_heads, head_dim, block_size))
        return blocks.view(dtype).permute(0, 3, 1, 2)

    v_view = transposed_view if v_transposed and dtype in V_TRANSPOSABLE else view
    return pool, [(view(pool[i, 0]), v_view(pool[i, 1])) for i in range(num_layers)]


def v_transposed(cache: torch.Tensor) -> bool:
    """Whether a cache view from ``allocate`` stores its blocks ``[heads, D, tokens]``
    (tokens adjacent, d a page apart; a page of one token is the same bytes either way)."""
    return cache.stride(3) != 1 and cache.stride(1) == 1 and cache.stride(3) == cache.shape[1]


def scales_of(cache: torch.Tensor) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads]
    """The fp32 scale view of a quantized cache from ``allocate`` (same memory), indexed
    ``[block, token, head]``; stored ``[head, token]`` in each block (strides ``(block,
    1, block_size)``)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    block_stride = cache.stride(0)
    scales = torch.as_strided(
        cache.view(torch.uint8),
        (num_blocks, num_kv_heads, block_size, SCALE_BYTES),
        (block_stride, block_size * SCALE_BYTES, SCALE_BYTES, 1),
        cache.storage_offset() + block_size * num_kv_heads * head_dim,
    )
    return scales.view(torch.float32).squeeze(-1).transpose(1, 2)


def quantize(
    x: torch.Tensor,  # [T, num_kv_heads, head_dim], any float dtype
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Hkv, D] dtype, [T, Hkv] fp32)
    """Per-(token, head) absmax quantization. int8 rounds half away from zero (as the
    Triton kernels do); fp8 rounds to nearest even and saturates at 448. A zero row
    gets scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1) * INV_QMAX[dtype]  # [T, Hkv]; see INV_QMAX
    y = xf / torch.where(scale > 0, scale, 1.0)[..., None]
    if dtype == torch.int8:
        y = (y.sign() * (y.abs() + 0.5).floor()).clamp(-127, 127)
    else:
        y = y.clamp(-448.0, 448.0)
    return y.to(dtype), scale


def dequantize(
    data: torch.Tensor,  # [..., Hkv, D] fp8/int8
    scales: torch.Tensor,  # [..., Hkv] fp32
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., Hkv, D] dtype
    return (data.float() * scales[..., None]).to(dtype)
