"""A decode graph's inputs from one upload, copied while the step before still runs.

A decode step replayed as a CUDA graph reads static buffers (``DecodeGraphs``). Filling
them cost ~30 us a step at batch 1 on an H200 (session 23's profile), all on the one
stream and so all between one step's last kernel and the next step's first: the
metadata's host-to-device copy (queued behind the previous step's token copy), three
int32 -> int64 conversions, the placeholder gather, five device copies and two fills.
Here:

- the host packs the step (``BatchBuilder.pack_decode``: ids, positions, lengths, KV
  slots, token slots, block table; int32) and ``SideUploads`` copies it to one of two
  device buffers on a side stream, which runs while the previous step's kernels do; the
  compute stream only waits for that copy;
- one kernel (``scatter_decode_inputs``) writes the graph's static inputs from it: the
  placeholders from ``last_tokens``, int64 positions and KV slots, the block-table rows,
  the token slots the sampler stores into, and the padding rows up to the graph's batch
  size (KV slot -1, length 1).

Device buffer k is written again two uploads later, after the scatter that read it (an
event); its pinned source, after the copy from it (an event the host waits for, long
done by then).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.protocols.step import PLACEHOLDER_TOKEN

FIELDS = 5  # per row: token id, position, sequence length, KV slot, token slot


# One compile per process: sizes unspecialized (a value of 1 or a multiple of 16 would
# each compile a variant, mid-serving, as a request's table grows); warmed up at capture.
@triton.jit(do_not_specialize=["stride_table", "num", "width"])
def _scatter_decode_inputs_kernel(
    packed_ptr,  # int32 [FIELDS * num + num * width]
    last_tokens_ptr,  # int32, by token slot
    ids_ptr,  # int32 [bs]
    positions_ptr,  # int64 [bs]
    seq_lens_ptr,  # int32 [bs]
    slot_mapping_ptr,  # int64 [bs]
    token_slots_ptr,  # int32 [bs]
    table_ptr,  # int32 [bs, >= width]
    stride_table,
    num,
    width,
    PLACEHOLDER: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num:
        token = tl.load(packed_ptr + row)
        token_slot = tl.load(packed_ptr + 4 * num + row)
        if token == PLACEHOLDER:
            token = tl.load(last_tokens_ptr + token_slot)
        tl.store(ids_ptr + row, token)
        tl.store(positions_ptr + row, tl.load(packed_ptr + num + row).to(tl.int64))
        tl.store(seq_lens_ptr + row, tl.load(packed_ptr + 2 * num + row))
        tl.store(slot_mapping_ptr + row, tl.load(packed_ptr + 3 * num + row).to(tl.int64))
        tl.store(token_slots_ptr + row, token_slot)
        source = packed_ptr + 5 * num + row * width
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            mask = cols < width
            values = tl.load(source + cols, mask=mask)
            tl.store(table_ptr + row * stride_table + cols, values, mask=mask)
    else:  # a padding row of the graph's batch: writes nowhere, reads one KV token
        tl.store(slot_mapping_ptr + row, tl.full((), -1, tl.int64))
        tl.store(seq_lens_ptr + row, tl.full((), 1, tl.int32))


def scatter_decode_inputs(
    packed: torch.Tensor,
    num: int,
    width: int,
    last_tokens: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_slots: torch.Tensor,
    block_tables: torch.Tensor,
    batch: int,
) -> None:
    """Fill rows ``[0, batch)`` of the static inputs from ``packed`` (``num`` real rows
    of ``width`` table columns; the rest padding). One kernel on a GPU."""
    assert num <= batch <= ids.shape[0] and width <= block_tables.shape[1]
    assert block_tables.stride(1) == 1
    if packed.device.type == "cuda" or triton_interpreted():
        _scatter_decode_inputs_kernel[(batch,)](
            packed, last_tokens, ids, positions, seq_lens, slot_mapping, token_slots,
            block_tables, block_tables.stride(0), num, width,
            PLACEHOLDER=PLACEHOLDER_TOKEN, BLOCK_W=128, num_warps=1,
        )  # fmt: skip
        return
    fields = packed[: FIELDS * num].view(FIELDS, num)
    slots = fields[4]
    known = last_tokens.index_select(0, slots.long())
    ids[:num] = torch.where(fields[0] == PLACEHOLDER_TOKEN, known, fields[0])
    positions[:num] = fields[1]
    seq_lens[:num] = fields[2]
    slot_mapping[:num] = fields[3]
    token_slots[:num] = slots
    block_tables[:num, :width] = packed[FIELDS * num :].view(num, width)
    slot_mapping[num:batch] = -1
    seq_lens[num:batch] = 1


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class SideUploads:
    """Host int32 tensors to the device on a side stream, into two alternating buffers.

    ``upload`` returns the device copy, which the compute stream waits for (it is usually
    done by the time the stream reaches it); ``consumed`` marks the last upload read by
    the compute stream's work so far, so that its buffer is written again only after.
    """

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._pinned = [torch.empty(capacity, dtype=torch.int32, pin_memory=True) for _ in "ab"]
        self._buffers = [torch.empty(capacity, dtype=torch.int32, device=device) for _ in "ab"]
        # The buffers came from the compute stream's pool: work queued there may still use
        # that memory under an older tensor (the first upload follows a prefill whose
        # temporaries the host has already freed, so the side stream's copy could land
        # before their last writes and the scatter read those; session 27: bf16 decode
        # after a 2,048-token prompt read a token id of garbage). The side stream starts
        # after that work, as it does after a growth below.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._consumed = [torch.cuda.Event(), torch.cuda.Event()]
        self._current = 0

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        k = self._current = self._current ^ 1
        n = host.numel()
        self._copied[k].synchronize()  # the copy out of pinned buffer k, two uploads ago
        compute = torch.cuda.current_stream(self.device)
        if n > self._pinned[k].numel():
            size = max(n, 2 * self._pinned[k].numel())
            self._pinned[k] = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._buffers[k] = torch.empty(size, dtype=torch.int32, device=self.device)
            # The new block came from the compute stream's pool: work queued there may
            # still use that memory under an older tensor.
            self.stream.wait_stream(compute)
        pinned, buffer = self._pinned[k][:n], self._buffers[k][:n]
        pinned.copy_(host.view(-1))
        self.stream.wait_event(self._consumed[k])
        with torch.cuda.stream(self.stream):
            buffer.copy_(pinned, non_blocking=True)
            self._copied[k].record(self.stream)
        compute.wait_event(self._copied[k])
        return buffer

    def consumed(self) -> None:
        """The compute stream's work queued so far is the last to read the last upload."""
        self._consumed[self._current].record(torch.cuda.current_stream(self.device))
