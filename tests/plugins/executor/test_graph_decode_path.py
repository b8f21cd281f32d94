"""The executor's graph decode path (``ModelRunner._graph_decode``: one packed upload, the
scatter into the graph's static inputs, the sampler's store or its fallback) gives the
tokens of the built-batch path. On the CPU the graph "replays" eagerly: the same static
buffers and graph metadata (padding rows, the graph's batch sizes), no CUDA."""

from __future__ import annotations

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.executor.cuda_graphs import DecodeGraphs


class EagerGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose upload is the host tensor and whose replay runs the captured
    forward eagerly on the static buffers."""

    def capture(self) -> None:
        for bs in self.sizes:
            self.metas[bs] = self._meta(bs)
            self.graphs[bs] = None  # type: ignore[assignment]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.input_ids.device)  # beside a GPU, the engine's device

    def _replay(self, bs: int) -> None:
        self.attn.prepare(self.metas[bs])
        self._run(bs)  # writes self.hidden


def _tokens(model: str, graphs: bool, replays: list[int]) -> list[list[int]]:
    llm = LLM(model, dtype="float32", attention="triton", async_scheduling=True, max_num_seqs=4)
    runner = llm.engine.executor
    if graphs:
        info = runner.info
        runner.graphs = EagerGraphs(
            runner.model, runner.attn, runner.kv_caches, 4, 64 // runner.block_size, 64,
            info.hidden_size, runner.dtype, runner.device,
        )  # fmt: skip
        runner.graphs.capture()
        inner = runner.graphs.run_pack

        def counted(pack, last_tokens):  # type: ignore[no-untyped-def]
            replays.append(pack.num)
            return inner(pack, last_tokens)

        runner.graphs.run_pack = counted  # type: ignore[method-assign]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, top_k=5),
    ]
    outs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13], [20]], params, use_tqdm=False)
    llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_graph_decode_path_gives_the_built_batch_tokens(tiny_model_factory) -> None:
    model = str(tiny_model_factory("llama"))
    replays: list[int] = []
    expected = _tokens(model, False, [])
    assert _tokens(model, True, replays) == expected
    # decode steps of 3, 2 and 1 requests (graph batches 4, 2, 1: padding rows included)
    assert 3 in replays and 1 in replays and len(replays) >= 6
