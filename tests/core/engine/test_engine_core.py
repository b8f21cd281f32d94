"""The in-process engine: config resolution, hooks, sizing."""

from __future__ import annotations

import pytest

from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine, resolve_config
from tokenloom.plugin_manager import PluginError, PluginManager
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams


class Recorder:
    def __init__(self) -> None:
        self.added: list[tuple[str, int]] = []
        self.finished: list[tuple[str, str, int]] = []
        self.built: list[str] = []

    @hookimpl
    def tokenloom_request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self.added.append((request_id, num_prompt_tokens))

    @hookimpl
    def tokenloom_request_finished(
        self, request_id: str, finish_reason: str, num_output_tokens: int
    ) -> None:
        self.finished.append((request_id, finish_reason, num_output_tokens))

    @hookimpl
    def tokenloom_components_built(self, components: dict) -> None:
        self.built = sorted(components)


def _engine(model_dir, plugin=None, **options) -> Engine:
    pm = PluginManager.default()
    if plugin is not None:
        pm.register(plugin, "recorder")
    return Engine.from_config(load_config(model=str(model_dir), **options), pm)


def test_auto_choices_resolve_to_the_cpu_stack():
    config = resolve_config(load_config(model="x"))
    assert (config.device, config.dtype, config.attention) == ("cpu", "float32", "torch")


def test_hooks_see_added_and_finished_requests_with_total_output_tokens(tiny_model_factory):
    recorder = Recorder()
    engine = _engine(tiny_model_factory("llama"), recorder)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    engine.add_request(GenerateRequest("a", [5, 6, 7], params))
    engine.add_request(GenerateRequest("b", [8, 9], params))
    while engine.has_unfinished():
        engine.step()
    assert sorted(recorder.added) == [("a", 3), ("b", 2)]
    assert sorted(recorder.finished) == [("a", "length", 7), ("b", "length", 7)]
    assert recorder.built == ["executor", "kv_cache", "scheduler"]


def test_aborted_request_is_reported_once_with_its_tokens(tiny_model_factory):
    recorder = Recorder()
    engine = _engine(tiny_model_factory("llama"), recorder)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request(GenerateRequest("a", [5, 6, 7], params))
    engine.step()
    engine.step()
    deltas = engine.abort(["a"])
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert recorder.finished == [("a", "abort", 2)]
    assert not engine.has_unfinished()
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def test_a_plugin_refusing_the_config_fails_start_up_with_its_name(tiny_model_factory):
    class Refuser:
        @hookimpl
        def tokenloom_configure(self, config) -> None:
            raise ValueError("max_num_seqs too large for me")

    with pytest.raises(PluginError, match="refuser.*max_num_seqs too large"):
        pm = PluginManager.default()
        pm.register(Refuser(), "refuser")
        Engine.from_config(load_config(model=str(tiny_model_factory("llama"))), pm)


def test_kv_pool_is_capped_and_reported_in_ready(tiny_model_factory):
    engine = _engine(tiny_model_factory("llama"), max_num_seqs=2, max_model_len=64)
    ready = engine.ready_info()
    assert ready.max_model_len == 64
    assert ready.num_blocks == engine.kv_cache.num_blocks <= 4 * 2 * (64 // 16)
    assert ready.eos_token_ids
    # The model's vocabulary (embedding rows), which frontends check token ids against.
    assert ready.vocab_size == engine.info.vocab_size > 0


def test_speculative_tokens_without_a_proposer_are_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="needs a proposer"):
        _engine(tiny_model_factory("llama"), num_speculative_tokens=2)


def test_decode_chunks_lead_every_step(tiny_model_factory):
    engine = _engine(tiny_model_factory("llama"), max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request(GenerateRequest("old", [5, 6, 7], params, priority=5))
    engine.step()
    engine.add_request(GenerateRequest("urgent", list(range(10, 50)), params, priority=-1))
    step = engine.scheduler.schedule()
    lengths = [len(c.token_ids) for c in step.chunks]
    assert lengths == sorted(lengths, key=lambda n: n != 1) and 1 in lengths and max(lengths) > 1
    engine.executor.execute(step)  # keep executor state consistent; result unused here
