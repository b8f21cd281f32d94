"""Pinned host memory reused for the small host-to-device copies of every step.

Allocating pinned memory costs far more than the copy itself, so each device gets
one growing pinned buffer, handed out by a bump pointer and rewound once per step.
A CUDA event after the last copy tells ``rewind`` when the buffer is free again.
On the CPU, uploads are plain conversions.
"""

from __future__ import annotations

import torch

_ALIGN = 64


class PinnedStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.offset = 0
        self.retired: list[torch.Tensor] = []  # outgrown buffers that copies may still read
        self.done = torch.cuda.Event()
        self.pending = False

    def rewind(self) -> None:
        """Start a new step: wait (normally no wait) for the last step's copies."""
        if self.pending:
            self.done.synchronize()
            self.pending = False
        self.offset = 0
        self.retired.clear()

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        if self.offset + nbytes > self.capacity:
            self.retired.append(self.buffer)
            self.capacity = max(2 * self.capacity, nbytes + _ALIGN)
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
            self.offset = 0
        staged = self.buffer[self.offset : self.offset + nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        device_copy = staged.to(self.device, non_blocking=True)
        self.done.record()
        self.pending = True
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


def rewind(device: torch.device) -> None:
    staging = staging_for(device)
    if staging is not None:
        staging.rewind()
