"""Message (de)serialization for every socket: msgspec msgpack, tensors as extra frames.

Build one ``Encoder`` and one ``Decoder`` per socket, once, and reuse them: msgspec
compiles its encoding plan per type on first use. ``encode`` returns the frames of
one multipart message: frame 0 is the msgpack body; every ``torch.Tensor`` or
``numpy.ndarray`` found in the message becomes an extra frame that references the
tensor's memory (zero-copy) and appears in the body as a ``TensorRef`` extension
(see ``tokenloom.protocols.tensors``). ``decode`` rebuilds such tensors over the
received frame buffers without copying. Nothing is ever pickled.

torch is imported only when a tensor is actually decoded (encoding finds it in
``sys.modules``: a process that holds a tensor has already imported torch).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from tokenloom.protocols.tensors import NUMPY_EXT, TORCH_EXT, TensorRef

T = TypeVar("T")
Frame = bytes | memoryview
# What a receiver may pass: bytes, memoryviews, or zmq.Frame objects (buffer protocol).
InFrame = Any


class DecodeError(ValueError):
    """A received message was refused. ``code`` is 400 (malformed or of the wrong
    type) or 413 (over the socket's maximum size); ``reason`` says why."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class Encoder:
    """Encodes messages of one socket into frames; not thread-safe (one per socket)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._ref_encoder = msgspec.msgpack.Encoder()
        self._extra: list[Frame] | None = None  # buffers of the message being encoded

    def encode(self, msg: Any) -> list[Frame]:
        """Frames of ``msg``: ``[body, *tensor_buffers]``. The buffers reference the
        tensors' memory: do not modify those tensors until the frames are sent."""
        self._extra = None
        body = self._encoder.encode(msg)
        extra, self._extra = self._extra, None
        if extra is None:
            return [body]
        return [body, *extra]

    def _enc_hook(self, obj: Any) -> Any:
        cls = type(obj)
        if cls.__name__ == "ndarray" and cls.__module__ == "numpy":
            return self._add_numpy(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._add_tensor(obj)
        raise NotImplementedError(f"cannot encode objects of type {cls.__qualname__}")

    def _add_frame(self, code: int, dtype: str, shape: list[int], buf: memoryview) -> Any:
        if self._extra is None:
            self._extra = []
        self._extra.append(buf)
        ref = TensorRef(dtype, shape, len(self._extra))
        return msgspec.msgpack.Ext(code, self._ref_encoder.encode(ref))

    def _add_tensor(self, tensor: Any) -> Any:
        import torch

        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # the one copy a device tensor needs to leave the device
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # [nbytes] uint8, same memory
        dtype = str(t.dtype).removeprefix("torch.")
        return self._add_frame(TORCH_EXT, dtype, list(t.shape), memoryview(raw))

    def _add_numpy(self, array: Any) -> Any:
        import numpy as np

        if array.dtype.hasobject:
            raise NotImplementedError("cannot encode numpy arrays of Python objects")
        a = np.ascontiguousarray(array)
        raw = a.reshape(-1).view(np.uint8)  # [nbytes] uint8, same memory
        return self._add_frame(NUMPY_EXT, a.dtype.str, list(a.shape), raw.data)


class Decoder(Generic[T]):
    """Decodes the frames of one socket into ``union_type``; not thread-safe.

    Raises ``DecodeError`` for a message over ``max_size`` bytes (all frames
    together; 413), malformed bytes, a wrong type or invalid field values, or a
    tensor reference that does not match its frame (400).
    """

    def __init__(self, union_type: type[T] | Any, max_size: int) -> None:
        self.max_size = max_size
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
            union_type, ext_hook=self._ext_hook
        )
        self._ref_decoder = msgspec.msgpack.Decoder(TensorRef)
        self._frames: list[memoryview] = []

    def decode(self, frames: Sequence[InFrame]) -> T:
        if not frames:
            raise DecodeError(400, "empty message")
        views = [memoryview(f) for f in frames]
        size = sum(v.nbytes for v in views)
        if size > self.max_size:
            raise DecodeError(413, f"message of {size} bytes exceeds the limit of {self.max_size}")
        self._frames = views
        try:
            return self._decoder.decode(views[0])
        except DecodeError:
            raise
        except msgspec.ValidationError as exc:
            raise DecodeError(400, f"invalid message: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise DecodeError(400, f"malformed message: {exc}") from exc
        except Exception as exc:  # a field's own validation (__post_init__) may raise anything
            raise DecodeError(400, f"invalid message: {exc}") from exc
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (TORCH_EXT, NUMPY_EXT):
            raise DecodeError(400, f"unknown msgpack extension code {code}")
        try:
            ref = self._ref_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise DecodeError(400, f"malformed tensor reference: {exc}") from exc
        if not 1 <= ref.frame < len(self._frames):
            raise DecodeError(400, f"tensor frame {ref.frame} missing")
        buf = self._frames[ref.frame]
        if code == TORCH_EXT:
            return _torch_from_buffer(ref, buf)
        return _numpy_from_buffer(ref, buf)


def _torch_from_buffer(ref: TensorRef, buf: memoryview) -> Any:
    import torch

    dtype = getattr(torch, ref.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(400, f"unknown tensor dtype {ref.dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    _check_size(ref, buf, itemsize)
    if buf.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    with warnings.catch_warnings():
        # Received frames are read-only; the tensor views them as they are.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)  # [nbytes] uint8, no copy
    return flat.view(dtype).view(ref.shape)


def _numpy_from_buffer(ref: TensorRef, buf: memoryview) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(ref.dtype)
    except TypeError as exc:
        raise DecodeError(400, f"unknown array dtype {ref.dtype!r}") from exc
    if dtype.hasobject:
        raise DecodeError(400, "arrays of Python objects are refused")
    _check_size(ref, buf, dtype.itemsize)
    return np.frombuffer(buf, dtype=dtype).reshape(ref.shape)


def _check_size(ref: TensorRef, buf: memoryview, itemsize: int) -> None:
    if any(s < 0 for s in ref.shape):
        raise DecodeError(400, f"negative tensor shape {ref.shape}")
    expected = math.prod(ref.shape) * itemsize
    if expected != buf.nbytes:
        raise DecodeError(
            400, f"tensor of shape {ref.shape} needs {expected} bytes, frame has {buf.nbytes}"
        )
