"""The decode graph's inputs from one packed upload: the scatter kernel writes what the
built batch holds (placeholders resolved, int64 positions and KV slots, table rows,
padding rows); the side-stream uploads never overwrite a buffer still to be read."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.executor.batch import BatchBuilder
from tokenloom.plugins.executor.graph_inputs import SideUploads, scatter_decode_inputs
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, ScheduledChunk, StepInput

BS = 4


def _statics(batch: int, cols: int) -> dict[str, torch.Tensor]:
    """Static buffers holding garbage, as a graph's hold the last step's values."""
    return {
        "ids": torch.full((batch,), 55, dtype=torch.int32),
        "positions": torch.full((batch,), 66, dtype=torch.int64),
        "seq_lens": torch.full((batch,), 77, dtype=torch.int32),
        "slot_mapping": torch.full((batch,), 88, dtype=torch.int64),
        "token_slots": torch.full((batch,), 99, dtype=torch.int32),
        "block_tables": torch.full((batch, cols), 44, dtype=torch.int32),
    }


@pytest.mark.parametrize("kernel", [True, False])
def test_the_scatter_writes_what_the_built_batch_holds(kernel: bool, monkeypatch) -> None:
    if not kernel:  # the torch path the CPU takes outside the test suite's interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    builder = BatchBuilder(BS, torch.device("cpu"), capacity=4)
    for request_id in "abc":
        builder.add_request(request_id)
    slots = torch.tensor([builder._slots[r] for r in "abc"])
    builder.last_tokens.index_copy_(0, slots, torch.tensor([101, 202, 303], dtype=torch.int32))
    step = StepInput(
        1,
        [
            ScheduledChunk("a", [PLACEHOLDER_TOKEN], 9, [7, 3, 11]),
            ScheduledChunk("b", [42], 0, [5]),
            ScheduledChunk("c", [PLACEHOLDER_TOKEN], 4, [2, 8]),
        ],
        num_tokens=3,
    )
    pack = builder.pack_decode(step)
    assert pack is not None and (pack.num, pack.width, pack.placeholders) == (3, 3, 2)
    built = builder.build(step)
    out = _statics(6, 8)
    scatter_decode_inputs(pack.host, 3, 3, builder.last_tokens, batch=5, **out)
    assert out["ids"].tolist() == built.input_ids.tolist() + [55] * 3 == [101, 42, 303] + [55] * 3
    assert out["positions"][:3].tolist() == built.positions.tolist() == [9, 0, 4]
    assert out["seq_lens"].tolist() == built.meta.seq_lens.tolist() + [1, 1, 77]
    assert out["slot_mapping"].tolist() == built.meta.slot_mapping.tolist() + [-1, -1, 88]
    assert out["token_slots"][:3].tolist() == built.sample_slots.tolist()
    assert torch.equal(out["block_tables"][:3, :3], built.meta.block_tables)
    assert (out["block_tables"][:3, 3:] == 44).all()  # past the width: never read, untouched
    assert (out["block_tables"][3:] == 44).all()  # padding rows keep (valid) old blocks
    assert out["positions"].dtype == out["slot_mapping"].dtype == torch.int64


def test_a_mixed_step_packs_nothing() -> None:
    builder = BatchBuilder(BS, torch.device("cpu"))
    builder.add_request("a")
    prefill = StepInput(1, [ScheduledChunk("a", [1, 2], 0, [3])], num_tokens=2)
    assert builder.pack_decode(prefill) is None
    not_sampled = StepInput(1, [ScheduledChunk("a", [1], 0, [3], False)], num_tokens=1)
    assert builder.pack_decode(not_sampled) is None


@pytest.mark.gpu
def test_gpu_an_upload_waits_for_the_buffer_s_last_reader() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    uploads = SideUploads(device, capacity=16)
    first = uploads.upload(torch.arange(8, dtype=torch.int32))
    torch.cuda._sleep(50_000_000)  # ~25 ms on the compute stream: the read below waits
    read = first.clone()
    uploads.consumed()
    second = uploads.upload(torch.full((8,), 7, dtype=torch.int32))
    third = uploads.upload(torch.full((8,), 9, dtype=torch.int32))  # first's buffer again
    assert third.data_ptr() == first.data_ptr() and second.data_ptr() != first.data_ptr()
    assert read.tolist() == list(range(8))  # not overwritten before the clone ran
    assert third.tolist() == [9] * 8 and second.tolist() == [7] * 8
    grown = uploads.upload(torch.arange(100, dtype=torch.int32))  # past the capacity
    assert grown.tolist() == list(range(100))


@pytest.mark.gpu
def test_gpu_the_first_upload_is_ordered_after_the_compute_stream_s_queued_work() -> None:
    # The new buffers may take memory the compute stream's queued work still writes (a
    # prefill's temporaries, freed on the host: session 27's crash), so the first copy
    # must follow that work. Tested as the ordering itself, whatever the allocator hands
    # out: with the compute stream busy (a long sleep queued), the side stream's first copy
    # must not have run 20 ms later (it is tiny: without the wait it ends in microseconds).
    # Session 28, on an H200: passes with the wait, fails without it. (An earlier version
    # that made the allocator hand over a block still to be written passed both ways.)
    import time

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    # the allocations first: a fresh pinned one may synchronize the device, which would
    # wait out the sleep below; freed, they are reused without a new allocation
    warm = SideUploads(device, capacity=64)
    del warm
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # >= 100 ms on the compute stream
    uploads = SideUploads(device, capacity=64)
    first = uploads.upload(torch.arange(64, dtype=torch.int32))
    time.sleep(0.02)
    assert not uploads._copied[uploads._current].query()  # still behind the sleep
    torch.cuda.synchronize()
    assert first.tolist() == list(range(64))


@pytest.mark.gpu
def test_gpu_the_token_copy_survives_the_allocator_reusing_its_memory() -> None:
    # PendingSample copies on a side stream; record_stream keeps the ids' block from the
    # compute stream's next allocation until that copy is done
    from tokenloom.plugins.executor.sampling.result import PendingSample

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda._sleep(50_000_000)  # the compute stream busy: the copy waits behind it
    values = torch.arange(4096, device="cuda")  # queued after the sleep
    pending = PendingSample(0, ["r"] * 4096, values, 0, ())
    del values
    junk = torch.full((4096,), -1, dtype=torch.int64, device="cuda")  # may take its block
    assert [t[0] for t in pending.result().token_ids] == list(range(4096))
    assert junk.sum().item() == -4096
