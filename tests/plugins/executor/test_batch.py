"""Flat batch building: the decode-only fast path equals the general path, and
placeholder inputs take each request's last sampled token."""

from __future__ import annotations

import torch

from tokenloom.plugins.executor.batch import BatchBuilder
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, ScheduledChunk, StepInput

BS = 4


def _builder() -> BatchBuilder:
    builder = BatchBuilder(BS, torch.device("cpu"), capacity=2)  # grows past 2 requests
    for request_id in ("a", "b", "c"):
        builder.add_request(request_id)
    return builder


def _decode_step() -> StepInput:
    chunks = [
        ScheduledChunk("a", [PLACEHOLDER_TOKEN], 9, [7, 3, 11]),
        ScheduledChunk("b", [42], 0, [5]),
        ScheduledChunk("c", [PLACEHOLDER_TOKEN], 4, [2, 8]),
    ]
    return StepInput(1, chunks, num_tokens=3)


def test_decode_fast_path_matches_the_general_path() -> None:
    builder = _builder()
    last = torch.tensor([101, 202, 303], dtype=torch.int32)
    slots = torch.tensor([builder._slots[r] for r in ("a", "b", "c")])
    builder.last_tokens.index_copy_(0, slots, last)
    step = _decode_step()
    fast, general = builder.build(step), builder._build_general(step)
    assert fast.input_ids.tolist() == general.input_ids.tolist() == [101, 42, 303]
    assert fast.positions.tolist() == general.positions.tolist() == [9, 0, 4]
    assert fast.meta.slot_mapping.tolist() == general.meta.slot_mapping.tolist()
    assert fast.meta.slot_mapping.tolist() == [11 * BS + 1, 5 * BS, 8 * BS]
    assert fast.meta.seq_lens.tolist() == general.meta.seq_lens.tolist() == [10, 1, 5]
    assert fast.meta.query_start_loc.tolist() == general.meta.query_start_loc.tolist()
    assert torch.equal(fast.meta.block_tables, general.meta.block_tables)
    assert fast.meta.decode_only and general.meta.decode_only
    assert fast.sample_request_ids == general.sample_request_ids == ["a", "b", "c"]
    assert general.sample_index is not None and general.sample_index.tolist() == [0, 1, 2]
    assert fast.sample_index is None  # every row samples
    assert torch.equal(fast.sample_slots, general.sample_slots)
    assert builder.build(step).sample_index is None  # build takes the fast path


def test_stored_sampled_tokens_fill_the_next_steps_placeholders() -> None:
    builder = _builder()
    step = _decode_step()
    first = builder.build(step)
    builder.store_sampled_tokens(first.sample_slots, torch.tensor([7, 8, 9]))
    again = builder.build(step)
    assert again.input_ids.tolist() == [7, 42, 9]
    builder.remove_requests(["a"])
    builder.add_request("d")  # reuses a's slot
    chunks = [ScheduledChunk("d", [1, 2, 3], 0, [4], True)]
    assert builder.build(StepInput(2, chunks, num_tokens=3)).input_ids.tolist() == [1, 2, 3]
