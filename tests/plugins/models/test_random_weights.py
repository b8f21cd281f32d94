"""Random weights (``load_format="random"``) give a greedy output that does not depend
on the kernel path (issue #11): the ``replay`` proposer drafts from a warm-up run, and a
timed run computed another way (prefix-cache hit, verify steps, another dtype) must
produce the same tokens or replay stops drafting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenloom import LLM
from tokenloom.bench.common import spec_summary
from tokenloom.bench.latency import decode_run
from tokenloom.checkpoints.model_shapes import write_shape_dir
from tokenloom.protocols.sampling import SamplingParams

VOCAB = 8192
PROMPT = [(7 * i + 11) % 990 + 10 for i in range(40)]


def _untied_shape(path: Path) -> str:
    """The llama-3-8b config (untied head) shrunk to a CPU-sized model."""
    root = write_shape_dir("llama-3-8b", path)
    config = json.loads((root / "config.json").read_text())
    config.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
    )
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _untied_shape(tmp_path_factory.mktemp("untied"))


def _successors() -> torch.Tensor:
    """succ[t]: the token randomize_weights' head puts after ``t`` (perm^-1)."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    succ = torch.empty_like(perm)
    succ[perm] = torch.arange(VOCAB)
    return succ


def test_random_untied_model_greedy_output_is_the_same_in_fp32_and_bf16(model_dir: str) -> None:
    outputs = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=model_dir, load_format="random", dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        outputs.append(list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids))
        llm.engine.shutdown()
    assert outputs[0] == outputs[1]
    succ = _successors()
    walk = [PROMPT[-1], *outputs[1]]
    assert all(int(succ[a]) == b for a, b in zip(walk, walk[1:], strict=False))
    assert len(set(outputs[1])) == len(outputs[1])  # a walk, not a repeated token


@pytest.mark.parametrize("acceptance", [0.8, 1.0])
def test_replay_keeps_drafting_through_another_kernel_path(
    model_dir: str, acceptance: float
) -> None:
    """bench latency's flow in bf16: the warm-up decodes plainly (no recording yet), the
    timed runs hit the prefix cache and verify 4 drafts a step; every step drafts and the
    rate is what ``acceptance`` implies: accepted / drafted = sum(a^i, i=1..4) / 4."""
    llm = LLM(
        model=model_dir,
        load_format="random",
        dtype="bfloat16",
        max_model_len=512,
        proposer="replay",
        num_speculative_tokens=4,
        plugin={"replay": {"acceptance": acceptance}},
    )
    engine = llm.engine
    warm = decode_run(engine, PROMPT, 200, "warmup")
    before = engine.stats()
    for run in range(2):
        assert len(decode_run(engine, PROMPT, 200, f"run-{run}")) == 200
    spec = spec_summary(before, engine.stats())
    engine.shutdown()
    assert len(warm) == 200
    assert spec is not None
    expected = sum(acceptance**i for i in range(1, 5)) / 4
    assert abs(spec["acceptance_rate"] - expected) < 0.08, spec
    # one verify step per 1 + accepted tokens: no step without drafts (left the recording)
    assert spec["verify_steps"] * spec["mean_accepted_length"] >= 2 * 199 - 8
