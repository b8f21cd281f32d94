"""The persistent host block table (issue 16): whatever happened to a request's
table between steps (grown, replaced after a preemption, a slot reused by a shorter
request, lists aliased and grown in place), each step's block table, slot mapping
and positions, from the decode path or the general path's rows, equal those the
general path builds from the chunks' block lists alone."""

from __future__ import annotations

import random

import torch

from tokenloom.plugins.executor.batch import BatchBuilder, DecodePack
from tokenloom.protocols.step import ScheduledChunk, StepInput

BS = 4


def _assert_same(builder: BatchBuilder, step: StepInput) -> None:
    """The persistent rows' batches (decode path when every chunk is one sampling
    token, the general path's rows otherwise) equal the from-scratch general path."""
    general = builder._build_general(step, from_scratch=True)
    if all(c.sample and len(c.token_ids) == 1 for c in step.chunks):
        fast = builder.build(step)
    else:
        fast = builder._build_general(step, from_scratch=False)
        # As aligned as the fresh tensor the from-scratch path makes (Triton specializes
        # kernels on 16-byte pointer alignment).
        assert fast.meta.block_tables.data_ptr() % 16 == 0
        assert fast.input_ids.tolist() == general.input_ids.tolist()
        assert fast.meta.query_start_loc.tolist() == general.meta.query_start_loc.tolist()
        assert fast.sample_index is not None and general.sample_index is not None
        assert fast.sample_index.tolist() == general.sample_index.tolist()
    assert torch.equal(fast.meta.block_tables, general.meta.block_tables)
    assert fast.meta.slot_mapping.tolist() == general.meta.slot_mapping.tolist()
    assert fast.positions.tolist() == general.positions.tolist()
    assert fast.meta.seq_lens.tolist() == general.meta.seq_lens.tolist()
    assert torch.equal(fast.sample_slots, general.sample_slots)


def test_replaced_and_shrunk_tables_leave_no_stale_blocks() -> None:
    builder = BatchBuilder(BS, torch.device("cpu"), capacity=2)
    builder.add_request("a")
    builder.add_request("b")
    long_table = [9, 8, 7, 6, 5]
    step = StepInput(
        1, [ScheduledChunk("a", [1], 17, long_table), ScheduledChunk("b", [2], 0, [3])]
    )
    _assert_same(builder, step)
    # a resumes after a preemption on other blocks, same length: every entry rewritten
    step = StepInput(2, [ScheduledChunk("a", [1], 17, [1, 2, 3, 4, 10])])
    assert builder.build(step).meta.block_tables.tolist() == [[1, 2, 3, 4, 10]]
    # a's slot goes to c, whose table is shorter: the row's tail reads as padding (0)
    builder.remove_requests(["a"])
    builder.add_request("c")
    step = StepInput(3, [ScheduledChunk("b", [2], 5, [3, 4]), ScheduledChunk("c", [5], 1, [11])])
    _assert_same(builder, step)
    assert builder.build(step).meta.block_tables.tolist() == [[3, 4], [11, 0]]


def test_random_histories_match_the_general_path() -> None:
    rng = random.Random(7)
    builder = BatchBuilder(BS, torch.device("cpu"), capacity=2)  # slots and width grow
    tables: dict[str, list[int]] = {}  # live tables, grown in place as a KV manager does
    lengths: dict[str, int] = {}
    next_id = 0
    for step_id in range(150):
        if len(tables) < 6 and rng.random() < 0.3:
            rid = f"r{next_id}"
            next_id += 1
            builder.add_request(rid)
            lengths[rid] = rng.randrange(1, 40)
            tables[rid] = [rng.randrange(1000) for _ in range(-(-lengths[rid] // BS))]
        if tables and rng.random() < 0.1:
            gone = rng.choice(sorted(tables))
            del tables[gone], lengths[gone]
            builder.remove_requests([gone])
        if tables and rng.random() < 0.1:  # preempted and resumed: a new list
            rid = rng.choice(sorted(tables))
            tables[rid] = [rng.randrange(1000) for _ in tables[rid]]
        for rid in tables:  # one decode each: a new block every BS tokens
            lengths[rid] += 1
            if -(-lengths[rid] // BS) > len(tables[rid]):
                tables[rid].append(rng.randrange(1000))
        if not tables:
            continue
        order = sorted(tables, key=lambda _: rng.random())
        chunks = []
        for r in order:
            q = 1 if rng.random() < 0.7 else rng.randrange(1, 5)  # else a prefill chunk
            chunks.append(
                ScheduledChunk(r, [1] * q, lengths[r] - q, tables[r], q == 1 or rng.random() < 0.5)
            )
        num_tokens = sum(len(c.token_ids) for c in chunks)
        _assert_same(builder, StepInput(step_id, chunks, num_tokens=num_tokens))


def _greedy_tokens(model_dir: str) -> tuple[dict[str, list[int]], int]:
    from tokenloom import LLM, SamplingParams
    from tokenloom.protocols.requests import GenerateRequest

    # A pool too small for all at once: preemptions, resumptions and slot reuse. On the
    # CPU even beside a GPU, whose decode steps take the CUDA graphs' inputs instead.
    llm = LLM(
        model_dir, max_num_seqs=6, block_size=4, num_blocks=40, max_num_batched_tokens=64,
        device="cpu",
    )  # fmt: skip
    rng = random.Random(3)
    for i in range(9):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 40), ignore_eos=True)
        llm.engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens, llm.engine.stats().num_preemptions


def test_greedy_tokens_equal_those_of_the_general_path(tiny_model_factory, monkeypatch) -> None:
    model_dir = str(tiny_model_factory("llama", max_position_embeddings=1024))
    decoded = []
    original = BatchBuilder._build_decode

    def counting(self: BatchBuilder, pack: DecodePack):  # type: ignore[no-untyped-def]
        decoded.append(pack.num)
        return original(self, pack)

    monkeypatch.setattr(BatchBuilder, "_build_decode", counting)
    fast, preemptions = _greedy_tokens(model_dir)
    assert preemptions > 0 and len(decoded) > 10  # the persistent rows were exercised
    monkeypatch.setattr(BatchBuilder, "build", BatchBuilder._build_general)
    general, _ = _greedy_tokens(model_dir)
    assert fast == general and len(fast) == 9
