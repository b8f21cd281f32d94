"""Quantizing each linear layer as it loads (``load_model(loaded=...)``, what the executor
does for a weight method that ``streams_layers``): the dense weights are never all held
at once, every layer is handed on exactly once with its tensors in place, and the result
is the model a whole load gives, for checkpoints, random weights and shards."""

from __future__ import annotations

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.int8 import Int8Quant


def _linears(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _dense_alive(model) -> int:
    """Linear layers holding a full dense weight now."""
    return sum(m.weight.shape == (m.out_features, m.in_features) for m in _linears(model).values())


class Recorder:
    """A ``loaded`` callback: checks the layer's weight is whole, notes how many dense
    weights were alive, then (``quantize``) gives the layer its int8 kernel."""

    def __init__(self, quantize: bool) -> None:
        self.model = None
        self.calls: list[str] = []
        self.alive: list[int] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.method = Int8Quant(EngineConfig(quant="int8")) if quantize else None

    def __call__(self, name: str, layer: Linear) -> None:
        assert layer.weight.shape == (layer.out_features, layer.in_features)
        self.calls.append(name)
        self.weights[name] = layer.weight.detach().clone()
        if self.model is not None:
            self.alive.append(_dense_alive(self.model))
        if self.method is not None:
            self.method.layer_loaded(name, layer)


def _load(path, recorder, random=False):
    import tokenloom.plugins.models.loader as loader

    name = "randomize_weights" if random else "load_weights"
    real = getattr(loader, name)

    def spy(model, *args, **kwargs):  # sees the model before its weights load
        recorder.model = model
        return real(model, *args, **kwargs)

    setattr(loader, name, spy)
    try:
        return load_model(path, torch.float32, "cpu", random_weights=random, loaded=recorder)
    finally:
        setattr(loader, name, real)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_layer_is_handed_on_once_whole_and_the_weights_match_a_whole_load(
    tiny_model_factory, arch
):
    path = tiny_model_factory(arch, num_layers=3)
    whole, _ = load_model(path, torch.float32, "cpu")
    recorder = Recorder(quantize=False)
    streamed, _ = _load(path, recorder)
    names = list(_linears(whole))
    assert sorted(recorder.calls) == sorted(names)  # each once
    for name, layer in _linears(whole).items():
        assert torch.equal(recorder.weights[name], layer.weight)
    for (name, a), b in zip(
        whole.state_dict().items(), streamed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_quantized_as_they_load_the_dense_model_is_never_whole(tiny_model_factory):
    path = tiny_model_factory("llama", num_layers=4)
    recorder = Recorder(quantize=True)
    model, _ = _load(path, recorder)
    total = len(_linears(model))
    assert total == 4 * 4  # qkv, o, gate/up, down per layer
    # at each hand-on: the layer itself and at most one other partly loaded one (q/k/v
    # straddles o in the file's order), never the model
    assert max(recorder.alive) <= 2 < total
    assert _dense_alive(model) == 0 and all(m.kernel is not None for m in _linears(model).values())
    # the same kernels a whole load then quantize_model gives
    reference, _ = load_model(path, torch.float32, "cpu")
    Int8Quant(EngineConfig(quant="int8")).quantize_model(reference)
    for name, layer in _linears(reference).items():
        assert torch.equal(_linears(model)[name].qweight, layer.qweight), name
    x = torch.randn(3, model.model.layers[0].self_attn.qkv_proj.in_features)
    a, b = (
        model.model.layers[2].self_attn.qkv_proj(x),
        reference.model.layers[2].self_attn.qkv_proj(x),
    )
    assert torch.equal(a, b)


def test_random_weights_stream_the_same_values(tiny_model_factory):
    path = tiny_model_factory("llama", num_layers=2)
    whole, _ = load_model(path, torch.float32, "cpu", random_weights=True)
    recorder = Recorder(quantize=False)
    streamed, _ = _load(path, recorder, random=True)
    assert sorted(recorder.calls) == sorted(_linears(whole))
    for (name, a), b in zip(
        whole.state_dict().items(), streamed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    # quantized as they are drawn: at most the layer being handed on is dense
    recorder = Recorder(quantize=True)
    _load(path, recorder, random=True)
    assert max(recorder.alive) == 1


def test_without_a_callback_every_weight_is_allocated_at_build(tiny_model_factory):
    model, _ = load_model(tiny_model_factory("llama"), torch.float32, "cpu")
    assert _dense_alive(model) == len(_linears(model))


def test_the_engine_streams_int8_and_int4_and_gives_the_whole_loads_tokens(tiny_model_factory):
    from tokenloom import LLM, SamplingParams
    from tokenloom.plugins.models import loader

    path = str(tiny_model_factory("llama", num_layers=2))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    for quant in ("int8", "int4", "fp8"):
        tokens = {}
        for streamed in (True, False):
            real = loader.load_model

            def whole(*args, real=real, **kwargs):
                kwargs["loaded"] = None  # the engine's load without streaming
                return real(*args, **kwargs)

            if not streamed:
                loader.load_model = whole
            try:
                llm = LLM(path, dtype="float32", quant=quant)
            finally:
                loader.load_model = real
            layer = llm.engine.executor.model.model.layers[0].mlp.down_proj
            assert layer.kernel is not None and layer.weight.numel() == 0
            tokens[streamed] = llm.generate([[5, 9, 2, 7]], params, use_tqdm=False)[0]
            tokens[streamed] = tokens[streamed].outputs[0].token_ids
            llm.engine.shutdown()
        assert tokens[True] == tokens[False] and len(tokens[True]) == 6, quant


def test_an_error_of_the_callback_is_raised_as_itself(tiny_model_factory):
    # not as the file's: "cannot read safetensors file" would send the user to the wrong place
    from tokenloom.plugins.models.loader import CheckpointError

    def failing(name, layer):
        raise ValueError(f"{name}: cannot quantize")

    with pytest.raises(ValueError, match="cannot quantize") as caught:
        load_model(tiny_model_factory("llama"), torch.float32, "cpu", loaded=failing)
    assert not isinstance(caught.value, CheckpointError)


def test_a_released_weight_is_never_allocated_again(tiny_model_factory):
    # a pre-quantized layer's weight, released by prepare_model, stays empty when the
    # loader (random weights) asks every Linear to materialize
    from tokenloom.plugins.models.loader import deferred_weights, randomize_weights
    from tokenloom.plugins.quant.common import release_weight

    with deferred_weights():
        layer = Linear(64, [32], bias=False, dtype=torch.float32)
    assert layer.deferred and layer.weight.shape == (0, 64)
    release_weight(layer)
    layer.materialize_weight()
    assert layer.weight.numel() == 0
    with deferred_weights():
        other = Linear(64, [32], bias=False, dtype=torch.float32)
    randomize_weights(torch.nn.ModuleDict({"a": other}))
    assert other.weight.shape == (32, 64) and not other.deferred and other.weight.std() > 0


def test_a_method_with_its_own_quantize_model_is_not_streamed():
    class Whole(Int8Quant):
        def quantize_model(self, model):  # e.g. calibrates over the whole model
            super().quantize_model(model)

    config = EngineConfig(quant="int8")
    assert Int8Quant(config).streams_layers and not Whole(config).streams_layers
