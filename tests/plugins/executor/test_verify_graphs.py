"""Speculative verify steps on static batches (``plugins/executor/verify_graphs.py``).

On the CPU there are no CUDA graphs, but ``VerifyGraphs.capture(use_graphs=False)``
prepares the same static metadata and ``run`` executes the forward on the static
buffers, so these tests check what the graphs depend on: which batches qualify, how a
step's inputs and the padding sequences are copied into the buffers, and that greedy
tokens through them (Triton attention under the interpreter, the kernels the GPU
graphs capture) equal the eager verify and no speculation at all. The GPU run of the
same comparison with real graphs is ``tests/plugins/proposer/test_spec_gpu.py``.
"""

from __future__ import annotations

import json
import os

import msgspec
import pytest
import torch

from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.plugins.executor.verify_graphs import VerifyGraphs, verify_batch_sizes
from tokenloom.protocols.components.attention import AttentionBackend, AttentionMetadata
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams


class _NoAttention(AttentionBackend):
    name = "none"

    def __init__(self) -> None:
        self.prepared: list[list[int]] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        self.prepared.append(list(meta.query_lens_cpu))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[override]
        raise AssertionError("not called")


class _EchoModel(torch.nn.Module):
    """Hidden row = (token id, position, the row's slot, its sequence's KV length)."""

    def forward(self, input_ids, positions, ctx):  # type: ignore[override]
        meta = ctx.meta
        seq = torch.repeat_interleave(
            torch.arange(meta.seq_lens.shape[0]), meta.query_start_loc.diff().long()
        )
        return torch.stack(
            [input_ids.float(), positions.float(), meta.slot_mapping.float(),
             meta.seq_lens[seq].float()], dim=1,
        )  # fmt: skip


def _graphs(k: int = 2, sizes: list[int] | None = None) -> tuple[VerifyGraphs, _NoAttention]:
    attn = _NoAttention()
    graphs = VerifyGraphs(
        _EchoModel(), attn, [], k, sizes or [1, 2, 4, 8], 6, 96, 4, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    graphs.capture(use_graphs=False)
    return graphs, attn


def test_buckets_follow_the_decode_sizes_up_to_the_limit() -> None:
    assert verify_batch_sizes(256, 64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert verify_batch_sizes(5, 64) == [1, 2, 4, 5]
    assert verify_batch_sizes(256, 0) == []


def test_only_uniform_one_plus_k_batches_that_fit_qualify() -> None:
    graphs, attn = _graphs(k=2)
    # every bucket prepared once with its constant query lengths
    assert sorted(attn.prepared, key=len) == [[3] * n for n in (1, 2, 4, 8)]
    assert graphs.can_run(num_seqs=3, num_tokens=9, max_query_len=3)
    assert graphs.can_run(num_seqs=8, num_tokens=24, max_query_len=3)
    assert not graphs.can_run(num_seqs=9, num_tokens=27, max_query_len=3)  # no bucket
    assert not graphs.can_run(num_seqs=3, num_tokens=8, max_query_len=3)  # one has k = 1
    assert not graphs.can_run(num_seqs=3, num_tokens=9, max_query_len=5)  # mixed lengths
    assert not graphs.can_run(num_seqs=3, num_tokens=3, max_query_len=1)  # plain decode
    with pytest.raises(ValueError):
        VerifyGraphs(_EchoModel(), attn, [], 0, [1], 6, 96, 4, torch.float32, torch.device("cpu"))


def test_fill_copies_the_step_and_pads_to_the_bucket() -> None:
    graphs, _ = _graphs(k=2)
    # A stale, larger step first: its rows must not leak into the padding.
    big = torch.arange(8 * 3, dtype=torch.int32)
    meta8 = AttentionMetadata(
        slot_mapping=torch.arange(24, dtype=torch.int64) + 100,
        query_start_loc=torch.arange(0, 27, 3, dtype=torch.int32),
        seq_lens=torch.full((8,), 50, dtype=torch.int32),
        block_tables=torch.full((8, 6), 7, dtype=torch.int32),
        max_query_len=3, max_seq_len=50, decode_only=False,
    )  # fmt: skip
    graphs.run(big, big.long(), meta8)
    ids = torch.tensor([11, 12, 13, 21, 22, 23, 31, 32, 33], dtype=torch.int32)
    positions = torch.tensor([4, 5, 6, 9, 10, 11, 0, 1, 2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([4, 5, 6, 13, 14, 15, 20, 21, 22]),
        query_start_loc=torch.tensor([0, 3, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([7, 12, 3], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [2, 3], [5, 0]], dtype=torch.int32),
        max_query_len=3, max_seq_len=12, decode_only=False,
    )  # fmt: skip
    assert graphs.fill(ids, positions, meta) == 4
    assert graphs.slot_mapping[9:12].tolist() == [-1, -1, -1]  # padding writes nowhere
    assert graphs.seq_lens[:4].tolist() == [7, 12, 3, 3]  # padding reads 1 + k rows
    assert graphs.query_start_loc[:5].tolist() == [0, 3, 6, 9, 12]  # constant
    assert graphs.block_tables[:3, :2].tolist() == [[0, 1], [2, 3], [5, 0]]
    hidden = graphs.run(ids, positions, meta)
    assert hidden.shape == (9, 4)
    assert hidden[:, 0].tolist() == ids.float().tolist()
    assert hidden[:, 1].tolist() == positions.float().tolist()
    assert hidden[:, 2].tolist() == meta.slot_mapping.float().tolist()
    assert hidden[:, 3].tolist() == [7.0] * 3 + [12.0] * 3 + [3.0] * 3
    assert graphs.replays == 2


# Triton attention on CPU tensors runs only under the interpreter (tests/conftest.py sets
# it where there is no GPU); on a GPU host the same comparison with captured graphs is
# tests/plugins/proposer/test_spec_gpu.py.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (the GPU form: test_spec_gpu.py)",
)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [10, 11, 12, 10, 11, 12, 10, 11], [3, 9, 3, 9, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def _generate(
    model_dir: object, verify_static: bool, params: SamplingParams = GREEDY, **options: object
):
    config = load_config(
        model=str(model_dir), device="cpu", attention="triton", num_blocks=48, block_size=4,
        **options,
    )  # fmt: skip
    engine = Engine.from_config(config)
    runner = engine.executor
    graphs = {}
    if verify_static:  # what init_kv_cache captures on CUDA, prepared without graphs
        graphs = runner._verify_graphs(24, 96)
        assert sorted(graphs) == [2, 3]  # 1 + k for k = 1, 2
        for verify in graphs.values():
            verify.capture(use_graphs=False)
        runner.verify_graphs = graphs
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{index}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    assert not engine.has_unfinished()
    return tokens, {width: verify.replays for width, verify in graphs.items()}


@needs_interpreter
def test_static_verify_batches_give_the_eager_and_plain_greedy_tokens(
    tiny_model_factory, tmp_path
) -> None:
    model = tiny_model_factory("llama")
    plain, _ = _generate(model, False)
    assert all(len(t) == GREEDY.max_tokens for t in plain.values())
    # The replay proposer drafts k tokens from the plain run's outputs, 60 % of them
    # right: uniform 1 + k batches (static) with accepts and rejections, and shorter
    # drafts near max_tokens (eager).
    recorded = tmp_path / "plain.jsonl"
    recorded.write_text(
        "".join(
            json.dumps({"prompt": p, "output": plain[f"r{i}"]}) + "\n"
            for i, p in enumerate(PROMPTS)
        )
    )
    spec = {
        "proposer": "replay",
        "num_speculative_tokens": 2,
        "plugin": {"replay": {"acceptance": 0.6, "path": str(recorded)}},
    }
    eager, _ = _generate(model, False, **spec)
    static, replays = _generate(model, True, **spec)
    assert eager == plain
    assert static == plain
    assert replays[3] >= 3 and replays[2] == 0  # k = 2, the engine's
    # A request's own k (1 here) replays the graphs of its width.
    own_k = msgspec.structs.replace(GREEDY, num_speculative_tokens=1)
    static, replays = _generate(model, True, own_k, **spec)
    assert static == plain
    assert replays[2] >= 3 and replays[3] == 0


@needs_interpreter
def test_the_fresh_prefill_option_runs_with_static_verify_batches(
    tiny_model_factory, tmp_path
) -> None:
    # prefill_fresh_16bit (an 8-bit cache's fresh prompts over their own 16-bit keys and
    # values): the verify graphs prepare static metadata with no host sequence lengths,
    # and with drafts the greedy tokens stay those of the same option without them
    model = tiny_model_factory("llama")
    option = {"triton": {"prefill_fresh_16bit": 1}}
    plain, _ = _generate(model, False, kv_cache_dtype="int8", plugin=option)
    recorded = tmp_path / "plain.jsonl"
    recorded.write_text(
        "".join(
            json.dumps({"prompt": p, "output": plain[f"r{i}"]}) + "\n"
            for i, p in enumerate(PROMPTS)
        )
    )
    replay = {"replay": {"acceptance": 0.6, "path": str(recorded)}}
    static, replays = _generate(
        model, True, kv_cache_dtype="int8", proposer="replay", num_speculative_tokens=2,
        plugin={**option, **replay},
    )  # fmt: skip
    assert static == plain
    assert replays[3] >= 3
