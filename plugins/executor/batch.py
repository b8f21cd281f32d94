"""Flat batch construction: one engine step's chunks -> device tensors.

The host packs every integer the step needs into one int32 buffer, copies it to
the device once (pinned, non-blocking on CUDA), and the device derives positions,
slot mapping and block tables from it. No host sync; a handful of small kernels.
Decode-only steps (every chunk one token) take a shorter path: the host computes
positions, slot mapping and the padded block table itself (O(batch + blocks), in
``array`` buffers), so the device runs about five small kernels instead of about
thirty, which at batch 1 is a measurable part of the step.

Placeholder inputs (``PLACEHOLDER_TOKEN``, async scheduling) are filled on the device
from ``last_tokens``: each live request owns a slot there, and every step writes the
tokens it samples into its rows' slots (``store_sampled_tokens``), so the next step
reads them without the host ever seeing them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from tokenloom.plugins.executor.staging import upload
from tokenloom.protocols.components.attention import AttentionMetadata
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int32 device
    positions: torch.Tensor  # [T] int64 device
    meta: AttentionMetadata
    # [S'] int64 device: rows whose logits are sampled (k + 1 per chunk with k drafts,
    # else one); None: all
    sample_index: torch.Tensor | None
    sample_slots: torch.Tensor  # [S] int64 device: the sampled requests' token slots
    sample_request_ids: list[str]
    num_tokens: int
    num_seqs: int


@dataclass
class DecodePack:
    """A decode-only step on the host: int32 ``[ids | positions | seq_lens | KV slots |
    token slots]`` (``num`` each) then the block table ``[num, width]``, as
    ``graph_inputs.scatter_decode_inputs`` reads it."""

    host: torch.Tensor
    num: int
    width: int
    placeholders: int  # ids that are PLACEHOLDER_TOKEN
    seq_lens: list[int]
    request_ids: list[str]


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, capacity: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        self.last_tokens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._slots: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._arange = torch.arange(0, 0, dtype=torch.int32, device=device)
        # Host block tables of the decode path, persistent per token slot: row ``slot``
        # holds ``self._rows[slot]`` then zeros, so a step writes only the blocks that
        # changed since the last (a decode adds one block every ``block_size`` steps)
        # instead of converting every table from Python ints again.
        self._width = 0  # columns of ``_table``
        self._table = array("i")  # [capacity * _width] int32, row-major
        self._rows: list[list[int]] = [[] for _ in range(capacity)]

    # ------------------------------------------------------------------ token slots

    def add_request(self, request_id: str) -> None:
        if request_id in self._slots:
            return
        if not self._free:
            old = self.last_tokens.shape[0]
            grown = torch.zeros(2 * old, dtype=torch.int32, device=self.device)
            grown[:old] = self.last_tokens
            self.last_tokens = grown
            self._free = list(range(2 * old - 1, old - 1, -1))
            self._table.extend(array("i", bytes(4 * old * self._width)))
            self._rows.extend([] for _ in range(old))
        self._slots[request_id] = self._free.pop()

    def remove_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def store_sampled_tokens(self, token_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Keep the tokens just sampled (device, one per sampling row, for the requests of
        ``token_slots``) for the placeholders of later steps."""
        self.last_tokens.index_copy_(0, token_slots.long(), token_ids.to(torch.int32))

    # ------------------------------------------------------------------ batches

    def _arange_to(self, n: int) -> torch.Tensor:
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 1024), dtype=torch.int32, device=self.device)
        return self._arange[:n]

    def build(self, step: StepInput) -> FlatBatch:
        pack = self._pack_decode(step)
        if pack is not None:
            return self._build_decode(pack)
        chunks = step.chunks
        slots = self._slots
        return self._build_general(step, not all(c.request_id in slots for c in chunks))

    def _build_general(self, step: StepInput, from_scratch: bool = True) -> FlatBatch:
        """Any step. The block table comes from the persistent host rows (as in the
        decode path), or, ``from_scratch`` (a chunk of a request without a token slot),
        from the chunks' flat block lists, placed on the device."""
        chunks = step.chunks
        slots = self._slots
        rows_known = self._rows
        rows = array("i")
        ids: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        blens: list[int] = []
        blocks: list[int] = []
        sample_rows: list[int] = []
        sample_slots: list[int] = []
        fill_rows: list[int] = []
        fill_slots: list[int] = []
        sample_ids: list[str] = []
        max_seq = 0
        for chunk in chunks:
            tokens = chunk.token_ids
            ids += tokens
            q = len(tokens)
            qlens.append(q)
            starts.append(chunk.start_pos)
            blens.append(len(chunk.block_ids))
            if from_scratch:
                blocks += chunk.block_ids
            else:
                slot = slots[chunk.request_id]
                rows.append(slot)
                if chunk.block_ids != rows_known[slot]:
                    self._write_row(slot, chunk.block_ids)
            end = chunk.start_pos + q
            if end > max_seq:
                max_seq = end
            if tokens[-1] == PLACEHOLDER_TOKEN:
                fill_rows.append(len(ids) - 1)
                fill_slots.append(slots[chunk.request_id])
            if chunk.sample:
                # A chunk with drafts keeps the logits of its last known token and of
                # every draft: the rows that verify them (speculative decoding).
                sample_rows.extend(range(len(ids) - 1 - chunk.num_draft_tokens, len(ids)))
                sample_slots.append(slots[chunk.request_id])
                sample_ids.append(chunk.request_id)
        num_tokens, num_seqs = len(ids), len(chunks)
        max_blocks = max(blens) if blens else 0
        gathered = 0 if from_scratch or not max_blocks else num_seqs * max_blocks
        small = ids + starts + qlens + blens + sample_rows + sample_slots + fill_rows + fill_slots
        # The rows' tables (padded to max_blocks) follow the small fields, from a
        # 16-byte boundary: attention kernels get a table as aligned as a fresh tensor
        # (Triton specializes on pointer alignment; a new variant would compile mid-run).
        pad = -len(small) % 4 if gathered else 0
        if gathered:
            host = torch.empty(len(small) + pad + gathered, dtype=torch.int32)
            host[: len(small)] = torch.tensor(small, dtype=torch.int32)
            table = torch.frombuffer(self._table, dtype=torch.int32).view(-1, self._width)
            torch.index_select(
                table[:, :max_blocks],
                0,
                torch.frombuffer(rows, dtype=torch.int32),
                out=host[len(small) + pad :].view(num_seqs, max_blocks),
            )
        else:
            host = torch.tensor(small + blocks, dtype=torch.int32)
        packed = upload(host, self.device)
        num_rows, num_sample, num_fill = len(sample_rows), len(sample_slots), len(fill_rows)
        d_ids, d_starts, d_qlens, d_blens, d_sample, d_slots, d_fill, d_fill_slots, _, d_blocks = (
            torch.split(
                packed,
                [
                    num_tokens,
                    num_seqs,
                    num_seqs,
                    num_seqs,
                    num_rows,
                    num_sample,
                    num_fill,
                    num_fill,
                    pad,
                    gathered or len(blocks),
                ],
            )  # fmt: skip
        )
        if num_fill:
            d_ids.index_copy_(
                0, d_fill.long(), self.last_tokens.index_select(0, d_fill_slots.long())
            )
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32, device=self.device)
        query_start_loc[1:] = torch.cumsum(d_qlens, 0, dtype=torch.int32)
        seq_lens = d_starts + d_qlens
        seq_index = torch.arange(num_seqs, device=self.device)
        token_seq = torch.repeat_interleave(seq_index, d_qlens, output_size=num_tokens)
        offsets = torch.arange(num_tokens, device=self.device, dtype=torch.int32)
        positions = (d_starts[token_seq] + offsets - query_start_loc[token_seq]).long()

        if gathered:
            block_tables = d_blocks.view(num_seqs, max_blocks)
        else:
            block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=self.device)
        if blocks:
            block_start = torch.zeros(num_seqs, dtype=torch.int64, device=self.device)
            block_start[1:] = torch.cumsum(d_blens[:-1], 0)
            block_seq = torch.repeat_interleave(seq_index, d_blens, output_size=len(blocks))
            block_col = torch.arange(len(blocks), device=self.device) - block_start[block_seq]
            block_tables[block_seq, block_col] = d_blocks
        bs = self.block_size
        slot_mapping = (
            block_tables[token_seq, positions // bs].long() * bs + positions % bs
            if num_tokens
            else torch.zeros(0, dtype=torch.int64, device=self.device)
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=max(qlens) if qlens else 0,
            max_seq_len=max_seq,
            decode_only=num_tokens == num_seqs,
            query_lens_cpu=qlens,
            seq_lens_cpu=[s + q for s, q in zip(starts, qlens, strict=True)],
        )
        return FlatBatch(
            input_ids=d_ids,
            positions=positions,
            meta=meta,
            sample_index=d_sample.long(),
            sample_request_ids=sample_ids,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            sample_slots=d_slots.long(),
        )

    def pack_decode(self, step: StepInput) -> DecodePack | None:
        """A decode-only step (every chunk one token that samples) packed on the host for
        one upload; None for any other step."""
        return self._pack_decode(step)

    def _pack_decode(self, step: StepInput) -> DecodePack | None:
        chunks = step.chunks
        slots = self._slots
        if not chunks or not all(c.sample and len(c.token_ids) == 1 for c in chunks):
            return None
        bs = self.block_size
        num = len(chunks)
        width = 0
        rows_known = self._rows
        ids = array("i")
        positions = array("i")
        lens = array("i")
        slot_mapping = array("i")
        rows = array("i")
        placeholders = 0
        for chunk in chunks:
            pos = chunk.start_pos
            blocks = chunk.block_ids
            token = chunk.token_ids[0]
            if token == PLACEHOLDER_TOKEN:
                placeholders += 1
            slot = slots[chunk.request_id]
            ids.append(token)
            positions.append(pos)
            lens.append(pos + 1)
            slot_mapping.append(blocks[pos // bs] * bs + pos % bs)
            rows.append(slot)
            if len(blocks) > width:
                width = len(blocks)
            if blocks != rows_known[slot]:  # compares values: an aliased list is fine
                self._write_row(slot, blocks)
        small = ids + positions + lens + slot_mapping + rows
        host = torch.empty(5 * num + num * width, dtype=torch.int32)
        host[: 5 * num] = torch.frombuffer(small, dtype=torch.int32)
        table = torch.frombuffer(self._table, dtype=torch.int32).view(-1, self._width)
        row_index = torch.frombuffer(rows, dtype=torch.int32)
        torch.index_select(table[:, :width], 0, row_index, out=host[5 * num :].view(num, width))
        return DecodePack(
            host, num, width, placeholders, lens.tolist(), [c.request_id for c in chunks]
        )

    def _build_decode(self, pack: DecodePack) -> FlatBatch:
        """Every chunk is one token that samples: positions, slot mapping, sequence
        lengths and the block table come from the host."""
        num, width = pack.num, pack.width
        packed = upload(pack.host, self.device)
        d_ids, d_pos, d_lens, d_slot, d_rows, d_table = torch.split(
            packed, [num, num, num, num, num, num * width]
        )
        row_slots = d_rows.long()
        if pack.placeholders == num:
            d_ids = self.last_tokens.index_select(0, row_slots)
        elif pack.placeholders:
            known = self.last_tokens.index_select(0, row_slots)
            d_ids = torch.where(d_ids == PLACEHOLDER_TOKEN, known, d_ids)
        meta = AttentionMetadata(
            slot_mapping=d_slot.long(),
            query_start_loc=self._arange_to(num + 1),
            seq_lens=d_lens,
            block_tables=d_table.view(num, width),
            max_query_len=1,
            max_seq_len=max(pack.seq_lens),
            decode_only=True,
            query_lens_cpu=[1] * num,
            seq_lens_cpu=pack.seq_lens,
        )
        return FlatBatch(
            input_ids=d_ids,
            positions=d_pos.long(),
            meta=meta,
            sample_index=None,
            sample_request_ids=pack.request_ids,
            num_tokens=num,
            num_seqs=num,
            sample_slots=row_slots,
        )

    def _write_row(self, slot: int, blocks: list[int]) -> None:
        """Make row ``slot`` of the host table hold ``blocks`` then zeros, writing only
        what differs from what it held (usually one appended block)."""
        if len(blocks) > self._width:
            self._widen(len(blocks))
        known = self._rows[slot]
        base = slot * self._width
        table = self._table
        num_known = len(known)
        num = len(blocks)
        if num >= num_known and blocks[:num_known] == known:  # appended to
            table[base + num_known : base + num] = array("i", blocks[num_known:])
        else:  # another table (a slot reused, a preempted request resumed)
            table[base : base + num] = array("i", blocks)
            if num_known > num:
                table[base + num : base + num_known] = array("i", bytes(4 * (num_known - num)))
        self._rows[slot] = list(blocks)  # a copy: the KV manager may grow the original

    def _widen(self, width: int) -> None:
        """Give every row of the host table at least ``width`` columns."""
        width = max(width, 2 * self._width, 16)
        old, old_width = self._table, self._width
        table = array("i", bytes(4 * len(self._rows) * width))
        for slot in range(len(self._rows)):
            table[slot * width : slot * width + old_width] = old[
                slot * old_width : (slot + 1) * old_width
            ]
        self._table, self._width = table, width
