"""CUDA green contexts through the driver API (ctypes): the GPU's SMs split in two.

A green context owns a share of the GPU's SMs; a stream made in it
(``cuGreenCtxStreamCreate``) runs the kernels launched on it on those SMs only. ``split(n)``
divides the device in two, at least ``n`` SMs (the driver rounds up to its partition
granularity) and the rest; ``GreenContext.stream()`` makes a torch stream in one
(``torch.cuda.ExternalStream``), so that torch, cuBLAS and Triton kernels run on a
partition under ``torch.cuda.stream(...)``. The two micro-batches of a decode step use it
to keep the attention on one partition and the projections on the other
(``micro_batches``, ``[plugin.model] micro_batch_sms``; session 41). The driver API is called
directly because torch 2.11's ``torch.cuda.green_contexts`` makes no stream.

Driver calls (CUDA 12.4+; the GPU hosts' driver is 580, CUDA 13.0): ``cuDeviceGetDevResource``
(the device's SMs), ``cuDevSmResourceSplitByCount`` (one group of ``n`` and the remainder),
``cuDevResourceGenerateDesc``, ``cuGreenCtxCreate``, ``cuGreenCtxStreamCreate``. A
``CUdevResource`` is 144 bytes in CUDA 12 headers (an int type, 92 bytes of padding, a
48-byte union whose first field is the SM count); only single resources are passed here,
so generous buffers stand in for the struct and no array stride depends on its size.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("tokenloom.executor")

RESOURCE_BYTES = 1024  # > sizeof(CUdevResource) in any header so far (144 in CUDA 12)
SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount: after the int type and 92 bytes of padding
CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    sigs = {
        "cuDeviceGet": [p, i],
        "cuDeviceGetDevResource": [i, p, i],
        "cuDevSmResourceSplitByCount": [p, p, p, p, u, u],
        "cuDevResourceGenerateDesc": [p, p, u],
        "cuGreenCtxCreate": [p, p, i, u],
        "cuGreenCtxStreamCreate": [p, p, u, i],
        "cuGetErrorName": [i, p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)  # AttributeError: a driver older than green contexts
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value!r} ({result})")


@dataclass
class GreenContext:
    """One green context: its SM count (as the driver reports it) and handle (kept for
    the process's life, never destroyed)."""

    sms: int
    handle: int
    lib: ctypes.CDLL

    device: int

    def stream(self) -> torch.cuda.ExternalStream:
        """A new non-blocking stream whose kernels run on this context's SMs."""
        stream = ctypes.c_void_p()
        made = self.lib.cuGreenCtxStreamCreate(
            ctypes.byref(stream), ctypes.c_void_p(self.handle), CU_STREAM_NON_BLOCKING, 0
        )
        _check(self.lib, made, "cuGreenCtxStreamCreate")
        assert stream.value is not None
        return torch.cuda.ExternalStream(stream.value, device=self.device)


def _sm_count(resource: ctypes.Array) -> int:  # type: ignore[type-arg]
    return int.from_bytes(resource.raw[SM_COUNT_OFFSET : SM_COUNT_OFFSET + 4], "little")


def _context(
    lib: ctypes.CDLL,
    device: ctypes.c_int,
    resource: ctypes.Array,
    index: int,  # type: ignore[type-arg]
) -> GreenContext:
    desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
    _check(lib, lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "GenerateDesc")
    _check(
        lib,
        lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, device, CU_GREEN_CTX_DEFAULT_STREAM),
        "cuGreenCtxCreate",
    )
    assert ctx.value is not None
    return GreenContext(_sm_count(resource), ctx.value, lib, index)


def split(sms: int, device_index: int | None = None) -> tuple[GreenContext, GreenContext]:
    """Two green contexts on the device: at least ``sms`` SMs, and the rest."""
    index = torch.cuda.current_device() if device_index is None else device_index
    torch.zeros(1, device=f"cuda:{index}")  # its primary context exists before the calls
    lib = _driver()
    device = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    whole, part, rest = (ctypes.create_string_buffer(RESOURCE_BYTES) for _ in range(3))
    _check(
        lib,
        lib.cuDeviceGetDevResource(device, whole, CU_DEV_RESOURCE_TYPE_SM),
        "cuDeviceGetDevResource",
    )
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < sms < total:
        raise RuntimeError(f"{sms} SMs for a green context: this device has {total}")
    groups = ctypes.c_uint(1)
    _check(
        lib,
        lib.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, sms),
        "cuDevSmResourceSplitByCount",
    )
    if groups.value != 1:
        raise RuntimeError(f"asked one group of {sms} SMs, got {groups.value}")
    first, second = _context(lib, device, part, index), _context(lib, device, rest, index)
    if _sm_count(whole) != total:  # a CUdevResource that keeps its count elsewhere
        log.warning("green contexts: SM counts unread (layout); %d asked", sms)
        first.sms, second.sms = sms, total - sms
    return first, second
