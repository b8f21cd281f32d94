"""Meta-test: one minimal component of every kind, written from ``protocols/`` alone
(``minimal_components.py``), is built through its registered factory contract and
run: the scheduler, KV manager, attention backend and proposer pass their
conformance suites; the executor serves the real engine; the model runs prefill and
decode through the attention backend; the quant method's kernels compute the layer;
the frontend serves through an ``EngineClient``."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import minimal_components as mc
import torch

from tokenloom.config import EngineConfig, load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.plugin_manager import PluginManager
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.protocols.components.attention import AttentionMetadata, ForwardContext
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.registry import KINDS, ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.outputs import EngineStats, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.testing import (
    AttentionConformance,
    KVCacheConformance,
    ProposerConformance,
    SchedulerConformance,
)

COMPONENTS = {
    "scheduler": mc.OneAtATimeScheduler,
    "kv_cache": mc.FreeListKV,
    "attention": mc.LoopAttention,
    "quant": mc.HalfPrecisionQuant,
    "executor": mc.HashExecutor,
    "proposer": mc.RepeatProposer,
    "frontend": mc.QueueFrontend,
    "model": mc.OneLayerModel,
}


def test_every_kind_has_a_minimal_component_that_imports_only_protocols() -> None:
    assert set(COMPONENTS) == set(KINDS)
    tree = ast.parse(Path(mc.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    ours = {name for name in imported if name.startswith("tokenloom")}
    assert ours and all(name.startswith("tokenloom.protocols") for name in ours), ours


class TestMinimalScheduler(SchedulerConformance):
    factory = mc.OneAtATimeScheduler
    reports_metrics = False


class TestMinimalKVCache(KVCacheConformance):
    factory = mc.FreeListKV


class TestMinimalAttention(AttentionConformance):
    factory = mc.LoopAttention


class TestMinimalProposer(ProposerConformance):
    factory = mc.RepeatProposer


class MinimalPlugin:
    @hookimpl
    def tokenloom_register_components(self) -> list[ComponentSpec]:
        return [ComponentSpec(kind, f"minimal-{kind}", cls) for kind, cls in COMPONENTS.items()]


def test_minimal_executor_scheduler_and_kv_manager_serve_the_real_engine() -> None:
    pm = PluginManager()
    pm.register(MinimalPlugin(), "minimal")
    config = load_config(max_model_len=128, max_num_batched_tokens=8, device="cpu")
    executor = pm.build("executor", "minimal-executor", config, pm)
    info = executor.load_model()
    kv = pm.build("kv_cache", "minimal-kv_cache", config, 16, 4)
    default_kv = PagedKVCache(config, 16, 4)
    results = {}
    for scheduler, pool in (
        (pm.build("scheduler", "minimal-scheduler", config, kv, clock=lambda: 0.0), kv),
        (ContinuousScheduler(config, default_kv), default_kv),
    ):
        engine = Engine(config, scheduler, pool, mc.HashExecutor(config, pm), info)
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        for i, prompt in enumerate([[3, 4, 5], list(range(1, 20)), [9]]):
            engine.add_request(GenerateRequest(f"r{i}", prompt, params))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        results[type(scheduler).__name__] = out
    minimal, default = results["OneAtATimeScheduler"], results["ContinuousScheduler"]
    assert minimal == default and all(len(tokens) == 5 for tokens in minimal.values())
    assert kv.num_free_blocks == kv.num_blocks


def _meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    slots = [
        table[p // 4] * 4 + p % 4
        for q, s, table in zip(query_lens, seq_lens, tables, strict=True)
        for p in range(s - q, s)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, *query_lens]).cumsum(0),
        seq_lens=torch.tensor(seq_lens), block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        decode_only=max(query_lens) == 1, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
    )  # fmt: skip


def test_minimal_model_decodes_from_its_kv_cache_as_a_full_prefill_would() -> None:
    pm = PluginManager()
    pm.register(MinimalPlugin(), "minimal")
    torch.manual_seed(0)
    model = pm.build("model", "minimal-model", {"vocab_size": 32, "heads": 2}, torch.float32)
    info = mc.HashExecutor(None, pm).load_model()
    info.num_heads = info.num_kv_heads = 2
    attn = pm.build("attention", "minimal-attention", EngineConfig(), info)
    ids = torch.tensor([5, 9, 2, 7, 1])
    positions = torch.arange(5)

    def caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(8, 4, 2, 8), torch.zeros(8, 4, 2, 8))]

    full = model(ids, positions, ForwardContext(attn, _meta([5], [5], [[3, 6]]), caches()))
    kv = caches()
    model(ids[:4], positions[:4], ForwardContext(attn, _meta([4], [4], [[3, 6]]), kv))
    last = model(ids[4:], positions[4:], ForwardContext(attn, _meta([1], [5], [[3, 6]]), kv))
    torch.testing.assert_close(last, full[4:])
    assert model.compute_logits(last).shape == (1, 32)


def test_minimal_quant_method_gives_layers_kernels_that_compute_them() -> None:
    layer = torch.nn.Linear(8, 4)
    layer.kernel = None  # the slot a quant method fills (plugins.models.layers.Linear)
    quant = PluginManager()
    quant.register(MinimalPlugin(), "minimal")
    method = quant.build("quant", "minimal-quant", EngineConfig())
    method.quantize_model(torch.nn.Sequential(layer))
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer.kernel.apply(x, layer.bias), layer(x), atol=1e-2, rtol=1e-2)
    assert layer.kernel.weight.dtype == torch.float16


class CountingClient(EngineClient):
    """An engine client that answers every request with its prompt's length, twice."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:  # type: ignore[override]
        n = len(request.prompt_token_ids)
        yield TokenDelta(request.request_id, [n])
        yield TokenDelta(request.request_id, [n], "length")

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def stats(self) -> EngineStats:
        return EngineStats()

    @property
    def is_alive(self) -> bool:
        return True


def test_minimal_frontend_is_built_as_serve_builds_it_and_serves() -> None:
    pm = PluginManager()
    pm.register(MinimalPlugin(), "minimal")
    spec = pm.component("frontend", "minimal-frontend")

    async def run() -> Any:
        frontend = spec.factory(EngineConfig(), CountingClient(), None, ready=None)
        task = asyncio.create_task(frontend.serve())
        await frontend.inbox.put([1, 2, 3])
        result = await asyncio.wait_for(frontend.outbox.get(), 5)
        task.cancel()
        return result

    assert asyncio.run(run()) == ([3, 3], "length")
