"""Pinned host memory reused for the small host-to-device copies of every step.

Allocating pinned memory costs far more than the copy itself, so each device gets
two growing pinned buffers, used by alternate steps, each handed out by a bump
pointer. ``begin_step`` (once per step) switches to the other buffer and waits for the
copies made from it two steps ago: with one step in flight (async scheduling) those
are long done, whereas waiting for the last step's copies would wait for that
step's forward pass whenever a copy was queued after it (the sampler's). A CUDA
event after each buffer's last copy says when it is free. On the CPU, uploads are
plain conversions.
"""

from __future__ import annotations

import torch

_ALIGN = 64


class _Buffer:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.retired: list[torch.Tensor] = []  # outgrown buffers that copies may still read
        self.done = torch.cuda.Event()
        self.pending = False


class PinnedStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self._buffers = (_Buffer(capacity), _Buffer(capacity))
        self._current = 0
        self.offset = 0

    def begin_step(self) -> None:
        """Start a new step on the other buffer: wait (normally no wait) for the copies
        made from it two steps ago."""
        self._current ^= 1
        staged = self._buffers[self._current]
        if staged.pending:
            staged.done.synchronize()
            staged.pending = False
        staged.retired.clear()
        self.offset = 0

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        buf = self._buffers[self._current]
        if self.offset + nbytes > buf.capacity:
            buf.retired.append(buf.buffer)
            buf.capacity = max(2 * buf.capacity, nbytes + _ALIGN)
            buf.buffer = torch.empty(buf.capacity, dtype=torch.uint8, pin_memory=True)
            self.offset = 0
        staged = buf.buffer[self.offset : self.offset + nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        device_copy = staged.to(self.device, non_blocking=True)
        buf.done.record()
        buf.pending = True
        return device_copy


_STAGING: dict[torch.device, PinnedStaging] = {}


def staging_for(device: torch.device) -> PinnedStaging | None:
    if device.type != "cuda":
        return None
    if device not in _STAGING:
        _STAGING[device] = PinnedStaging(device)
    return _STAGING[device]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a host sync."""
    staging = staging_for(torch.device(device))
    if staging is None:
        return host.to(device)
    return staging.upload(host)


def begin_step(device: torch.device) -> None:
    """Start a step's uploads to ``device`` (see ``PinnedStaging.begin_step``)."""
    staging = staging_for(device)
    if staging is not None:
        staging.begin_step()
