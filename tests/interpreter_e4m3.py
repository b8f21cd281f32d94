"""Under TRITON_INTERPRET=1, e4m3 conversions as the GPU does them.

Triton's interpreter (``triton.runtime.interpreter._convert_float``, Triton 3.9) gets fp8
e4m3 wrong in three ways the GPU does not: a mantissa that rounds up into the next
power of two ORs its carry into the exponent instead of adding it (124.8 -> 64, where the
GPU gives 128; 55 of 4,096 random values), ties round up instead of to even, and the NaN
byte reads as 480. The GPU's cast (``cvt.rn.satfinite``) rounds to nearest even and
saturates at 448. ``install()`` routes the interpreter's conversions to and from e4m3
through torch's (the same rounding, saturated first); every other conversion is
Triton's own. The tests install it when the interpreter runs (``conftest.py``), so that
the fp8 kernels' CPU results are the GPU's arithmetic, not the interpreter's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_FLOATS = {32: (np.float32, np.uint32, torch.float32), 16: (np.float16, np.uint16, torch.float16)}


def install() -> bool:
    """Patch the interpreter (once); False where its converter is not the one known."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "e4m3_fixed", False):
        return original is not None

    def convert(data: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        fp8 = tl.float8e4nv
        if (
            output_dtype == fp8
            and input_dtype.is_floating()
            and input_dtype.primitive_bitwidth in _FLOATS
        ):
            np_float, _, _ = _FLOATS[input_dtype.primitive_bitwidth]
            x = torch.from_numpy(np.ascontiguousarray(data).view(np_float).astype(np.float32))
            y = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # NaN stays NaN
            return y.view(torch.uint8).numpy().reshape(data.shape)
        if (
            input_dtype == fp8
            and output_dtype.primitive_bitwidth in _FLOATS
            and output_dtype.is_floating()
        ):
            _, np_uint, torch_float = _FLOATS[output_dtype.primitive_bitwidth]
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
            return (
                raw.view(torch.float8_e4m3fn)
                .to(torch_float)
                .numpy()
                .view(np_uint)
                .reshape(data.shape)
            )
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert.e4m3_fixed = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert
    return True
