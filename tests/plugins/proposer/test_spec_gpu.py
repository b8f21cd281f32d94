"""GPU: speculative decoding keeps greedy tokens identical with CUDA graphs and Triton.

The reference runs without speculation (CUDA graphs for decode steps, async
scheduling on); the speculative runs verify on the Triton extend path (eager) and
decode their non-speculating steps in graphs. fp32: tokens must be identical
(bf16 near-ties may flip an argmax between the decode and extend kernels; see
``tests/plugins/executor/test_gpu_modes.py``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 2, 33, 17] * 4, [40, 41, 42] * 7, list(range(100, 180)), [7, 8, 7, 8, 7]]


def _generate(model_dir, **options):
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cuda", dtype="float32", attention="triton", **options)
    assert llm.engine.executor.graphs is not None, "CUDA graphs were not captured"
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1),
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    stats = llm.engine.stats()
    llm.engine.shutdown()
    return outs, stats


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-small"])
def test_speculative_greedy_tokens_equal_the_graph_decode(tiny_model_factory, proposer):
    model = tiny_model_factory("llama", num_heads=8, num_kv_heads=2, hidden_size=256)
    reference, _ = _generate(model)
    options: dict = {"proposer": proposer.split("-")[0], "num_speculative_tokens": 4}
    if proposer == "draft-self":
        options["draft_model"] = str(model)
    elif proposer == "draft-small":
        options["draft_model"] = str(
            tiny_model_factory("llama", num_heads=4, num_kv_heads=2, hidden_size=64, seed=5)
        )
    spec, stats = _generate(model, **options)
    assert spec == reference
    assert stats.spec_verify_steps_total > 0
    if proposer == "draft-self":
        assert stats.spec_accepted_tokens_total >= 0.95 * stats.spec_draft_tokens_total
