"""How a message carries a tensor or an array: as an extra zero-copy frame.

A field annotated ``Tensor`` (or ``Array``) holds a ``torch.Tensor`` (or a
``numpy.ndarray``) in Python. On the wire, frame 0 holds the msgpack body, where the
field is a msgpack extension whose payload is a ``TensorRef``: dtype, shape, and the
index of the extra frame that holds the raw bytes. The receiver's decoder rebuilds
the tensor straight over that frame's buffer (no copy). Nothing is pickled.

torch is imported only for type checking: at run time ``Tensor`` is ``Any`` for
msgspec, so importing a message module never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

# msgpack extension codes of the two kinds of buffer.
TORCH_EXT = 1
NUMPY_EXT = 2

if TYPE_CHECKING:
    from numpy import ndarray as Array
    from torch import Tensor
else:
    Tensor = Any
    Array = Any


class TensorRef(msgspec.Struct, array_like=True, gc=False):
    """The payload of a tensor's msgpack extension.

    ``dtype`` is the element type's name without module (``"float16"``,
    ``"bfloat16"``, ``"int64"``); ``shape`` the sizes; ``frame`` the index of the
    extra frame (>= 1) whose bytes are the C-contiguous elements.
    """

    dtype: str
    shape: list[int]
    frame: int


__all__ = ["NUMPY_EXT", "TORCH_EXT", "Array", "Tensor", "TensorRef"]
