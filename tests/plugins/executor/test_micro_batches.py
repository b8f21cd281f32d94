"""Two micro-batches in one decode step (``plugins.executor.micro_batches``): the halves'
metadata, the model's layer-by-layer forward, and the tokens of a step run as two halves
against the same step whole. On the CPU the halves run one after the other on one stream
(the arithmetic and the metadata; the Triton backend through the interpreter, with its
decode scratch per lane); on a GPU in one CUDA graph on two streams."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.executor import cuda_graphs, micro_batches
from tokenloom.plugins.executor.cuda_graphs import DecodeGraphs
from tokenloom.plugins.executor.micro_batches import half_metas
from tokenloom.protocols.components.attention import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode_meta(rows: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(rows) * 16,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.arange(1, rows + 1, dtype=torch.int32),
        block_tables=torch.arange(rows * 3, dtype=torch.int32).view(rows, 3),
        max_query_len=1,
        max_seq_len=64,
        decode_only=True,
        extra={"kept": 1},
    )


def test_half_metas_are_views_of_each_half_on_their_own_lanes() -> None:
    meta = _decode_meta(6)
    first, second = half_metas(meta, 4)
    assert first.seq_lens.tolist() == [1, 2, 3, 4] and second.seq_lens.tolist() == [5, 6]
    assert second.slot_mapping.tolist() == [64, 80]
    assert torch.equal(second.block_tables, meta.block_tables[4:])
    assert first.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert second.query_start_loc.tolist() == [0, 1, 2]
    assert (first.extra, second.extra) == ({"kept": 1, "lane": 0}, {"kept": 1, "lane": 1})
    assert meta.extra == {"kept": 1}  # the step's own metadata is untouched
    second.seq_lens.fill_(9)  # views: the graph's static buffers feed both halves
    assert meta.seq_lens[4:].tolist() == [9, 9]
    with pytest.raises(ValueError, match="decode"):
        half_metas(AttentionMetadata(**{**meta.__dict__, "decode_only": False}), 3)
    with pytest.raises(ValueError, match="half"):
        half_metas(meta, 6)


def test_the_model_s_steps_are_its_forward(tiny_model_factory) -> None:
    """``forward_steps`` yields between decoder layers (one fewer yield than layers) and
    returns what ``forward`` returns."""
    # on the CPU: the inputs and the context below are host tensors
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", attention="torch", device="cpu")
    try:
        runner = llm.engine.executor
        model = runner.model
        layers = len(model.model.layers)
        calls: list[int] = []
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
        steps = model.forward_steps(torch.tensor([5]), torch.tensor([0]), _empty_context(runner))
        yields = 0
        while True:
            try:
                next(steps)
                yields += 1
                assert calls == list(range(yields))  # a layer a step
            except StopIteration as done:
                hidden = done.value
                break
        assert yields == layers - 1 and calls == list(range(layers))
        assert hidden.shape == (1, runner.info.hidden_size)
    finally:
        llm.shutdown()


def _empty_context(runner):  # type: ignore[no-untyped-def]
    from tokenloom.protocols.components.attention import ForwardContext

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), max_query_len=1, max_seq_len=16,
        decode_only=True, query_lens_cpu=[1], seq_lens_cpu=[1],
    )  # fmt: skip
    runner.attn.prepare(meta)
    return ForwardContext(runner.attn, meta, runner.kv_caches)


def test_attention_launches_take_turns_across_streams(monkeypatch) -> None:
    """``TakeTurns``: the first launch waits on nothing; each later one, on whichever
    stream, waits on the event its predecessor recorded (CUDA's streams and events
    stood in for by recorders)."""
    log: list[tuple[str, ...]] = []

    class Event:
        count = 0

        def __init__(self) -> None:
            Event.count += 1
            self.name = f"e{Event.count}"

        def record(self, stream: Stream) -> None:
            log.append(("record", self.name, stream.name))

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event: Event) -> None:
            log.append(("wait", self.name, event.name))

    current = [Stream("a")]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])

    class Backend:
        name = "inner"

        def forward(self, x: str) -> str:
            log.append(("attend", current[0].name, x))
            return x

    turns = micro_batches.TakeTurns(Backend())  # type: ignore[arg-type]
    assert turns.name == "inner"  # every other attribute is the backend's
    for stream, x in (("a", "A0"), ("b", "B0"), ("a", "A1")):
        current[0] = Stream(stream)
        assert turns.forward(x) == x
    assert log == [
        ("attend", "a", "A0"), ("record", "e1", "a"),
        ("wait", "b", "e1"), ("attend", "b", "B0"), ("record", "e2", "b"),
        ("wait", "a", "e2"), ("attend", "a", "A1"), ("record", "e3", "a"),
    ]  # fmt: skip


def test_attention_runs_on_its_own_stream_between_waits(monkeypatch) -> None:
    """``OnStream``: the attention's stream waits for the caller's, the launch runs on
    it, the caller's waits for it, and the output is marked as used on the caller's
    (CUDA's streams stood in for by recorders)."""
    import contextlib

    log: list[tuple[str, ...]] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(("wait", self.name, other.name))

    class Out:
        def record_stream(self, stream: Stream) -> None:
            log.append(("used on", stream.name))

    current = [Stream("half a")]

    @contextlib.contextmanager
    def on(stream: Stream):  # type: ignore[no-untyped-def]
        before, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "stream", on)

    class Backend:
        name = "inner"

        def forward(self, x: str) -> Out:
            log.append(("attend", current[0].name, x))
            return Out()

    wrapped = micro_batches.OnStream(Backend(), Stream("attention"))  # type: ignore[arg-type]
    assert wrapped.name == "inner"  # every other attribute is the backend's
    wrapped.forward("A0")
    assert current[0].name == "half a"
    assert log == [
        ("wait", "attention", "half a"), ("attend", "attention", "A0"),
        ("wait", "half a", "attention"), ("used on", "half a"),
    ]  # fmt: skip


class EagerGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose "replay" runs the captured forward eagerly on the static
    buffers (no CUDA: the halves one after the other on one stream)."""

    def capture(self) -> None:
        for bs in self.sizes:
            self._plan(bs)
            self.graphs[bs] = None  # type: ignore[assignment]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.input_ids.device)  # beside a GPU, the engine's device

    def _replay(self, bs: int) -> None:
        self._run(bs)


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], list(range(30, 47)), [3, 4], [40, 41, 42, 43]]


def _cpu_tokens(model: str, attention: str, micro: int, halves: list[int]) -> list[list[int]]:
    llm = LLM(model, dtype="float32", attention=attention, max_num_seqs=8)
    try:
        runner = llm.engine.executor
        runner.graphs = EagerGraphs(
            runner.model, runner.attn, runner.kv_caches, 8, 64 // runner.block_size, 64,
            runner.info.hidden_size, runner.dtype, runner.device, micro_batch_min=micro,
        )  # fmt: skip
        runner.graphs.capture()
        run = runner.graphs._run

        def counted(bs: int) -> None:
            if bs in runner.graphs.halves:
                halves.append(bs)
            run(bs)

        runner.graphs._run = counted  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if attention == "triton" and micro:
            assert set(runner.attn.scratch.lanes) == {0, 1}  # lane 1's scratch apart
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_two_halves_give_the_whole_step_s_tokens(attention, tiny_model_factory, monkeypatch):
    """Buckets of 4 and 8 requests as two halves (the rows' floor lowered for a tiny
    batch): the same greedy tokens as each step whole."""
    monkeypatch.setattr(cuda_graphs, "MIN_HALF", 2)
    model = str(tiny_model_factory("llama"))
    whole: list[int] = []
    halves: list[int] = []
    expected = _cpu_tokens(model, attention, 0, whole)
    got = _cpu_tokens(model, attention, 4, halves)
    assert not whole and halves and set(halves) <= {4, 8}
    assert 8 in halves  # six requests decode together in the 8-request bucket
    assert got == expected


def test_micro_batches_need_a_backend_that_keeps_lanes_apart(tiny_model_factory) -> None:
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", attention="torch")
    try:
        runner = llm.engine.executor

        def graphs() -> DecodeGraphs:
            return EagerGraphs(
                runner.model, runner.attn, runner.kv_caches, 128, 4, 64,
                runner.info.hidden_size, runner.dtype, runner.device, micro_batch_min=16,
            )  # fmt: skip

        assert graphs().micro_min == 2 * micro_batches.MIN_HALF  # raised to the rows' floor
        runner.attn.supports_micro_batches = False  # an instance attribute, this test only
        assert graphs().micro_min == 0
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs on two streams")
@pytest.mark.parametrize("turns, sms", [(True, 0), (False, 0), (True, 48)])
def test_two_streams_in_one_graph_give_the_whole_step_s_tokens(turns, sms, tiny_model_factory):
    """A tiny fp32 Llama, 80 requests at once (the 80-request bucket as two halves of 40,
    each on its own stream in one CUDA graph, taking turns at the attention or not; with
    ``sms``, the attention on a green context of that many SMs, the halves on the rest,
    eagerly): the greedy tokens of the graphs without micro-batches."""
    model = str(tiny_model_factory("llama", hidden_size=256, intermediate_size=512,
                                   num_heads=4, num_kv_heads=2))  # fmt: skip
    prompts = [[(7 * i + j) % 200 + 3 for j in range(1 + i % 23)] for i in range(80)]

    def tokens(micro: int) -> tuple[list[list[int]], DecodeGraphs]:
        plugin = {"model": {"micro_batch_min": micro, "micro_batch_turns": turns,
                            "micro_batch_sms": sms}}  # fmt: skip
        llm = LLM(model, dtype="float32", device="cuda", attention="triton", max_num_seqs=80,
                  plugin=plugin)  # fmt: skip
        try:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            graphs = llm.engine.executor.graphs
            return [list(o.outputs[0].token_ids) for o in outs], graphs
        finally:
            llm.shutdown()

    whole, plain = tokens(0)
    split, graphs = tokens(64)
    assert not plain.halves and 80 in graphs.halves and graphs.half_streams[1] is not None
    assert (graphs.attention_stream is not None) == bool(sms)
    assert graphs.micro_eager == bool(sms) and (graphs.graphs[80] is None) == bool(sms)
    print(f"green contexts: {bool(sms)}, attention SMs {graphs.attention_sms}")
    assert split == whole


def test_the_second_half_dequantizes_into_its_own_buffer() -> None:
    """int4 / int8's whole-weight dequantization reuses one buffer; half B's launches
    (lane 1) get another, since the halves' GEMMs may run at once."""
    from tokenloom.plugins.quant.kernels import dequant
    from tokenloom.protocols.components.quant import MICRO_BATCH_LANE

    first = dequant.reserve(64, torch.float16, torch.device("cpu"))
    token = MICRO_BATCH_LANE.set(1)
    try:
        second = dequant.reserve(64, torch.float16, torch.device("cpu"))
    finally:
        MICRO_BATCH_LANE.reset(token)
    assert second.data_ptr() != first.data_ptr()
    assert dequant.reserve(32, torch.float16, torch.device("cpu")).data_ptr() == first.data_ptr()
    for lane in (0, 1):
        token = MICRO_BATCH_LANE.set(lane)
        dequant.release(torch.float16, torch.device("cpu"))
        MICRO_BATCH_LANE.reset(token)


@pytest.mark.parametrize("key", ["micro_batch_min", "micro_batch_sms"])
def test_a_negative_micro_batch_setting_is_refused(key: str) -> None:
    from tokenloom.config import ConfigError, EngineConfig, plugin_settings
    from tokenloom.plugins.executor.settings import ModelExecutorSettings

    config = EngineConfig(plugin={"model": {key: -1}})
    with pytest.raises(ConfigError, match=key):
        plugin_settings(config, "model", ModelExecutorSettings)


def test_green_contexts_that_cannot_be_made_fall_back_to_plain_streams(
    tiny_model_factory, monkeypatch, caplog
) -> None:
    """``micro_batch_sms`` where the driver has no green contexts (or the count is past
    the device's SMs): a warning, and the halves on the capture stream and a side one."""
    from tokenloom.plugins.executor import green_contexts

    def refuse(sms: int, index: int | None = None) -> None:
        raise RuntimeError(f"{sms} SMs for a green context: this device has 8")

    monkeypatch.setattr(green_contexts, "split", refuse)
    # on the CPU (a GPU's engine makes streams of its own, which the stand-in would break)
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", attention="torch", device="cpu")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: "side")
    try:
        runner = llm.engine.executor
        graphs = EagerGraphs(
            runner.model, runner.attn, runner.kv_caches, 128, 4, 64, runner.info.hidden_size,
            runner.dtype, runner.device, micro_batch_min=64, micro_batch_sms=200,
        )  # fmt: skip
        with caplog.at_level("WARNING", logger="tokenloom.executor"):
            graphs._make_streams()
        assert graphs.half_streams == (None, "side") and graphs.attention_stream is None
        assert "no green contexts" in caplog.text and "has 8" in caplog.text
    finally:
        llm.shutdown()
