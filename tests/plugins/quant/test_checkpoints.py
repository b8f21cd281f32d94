"""Pre-quantized checkpoints load directly: an fp8 checkpoint (per-tensor scales, as
vLLM reads them) and AWQ / GPTQ 4-bit ones. Each is written here from a tiny random
model; the loaded kernels must hold exactly the stored values, and the engine must
generate from them the same tokens as from a 16-bit checkpoint of the same values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4, unpack_int4
from tokenloom.plugins.quant.int4_checkpoints import AWQ_ORDER, unpack_columns

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42]]


def pack_columns(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, N]`` values 0..15 -> ``[R, N / 8]`` int32, nibble j = column 8c + order[j]."""
    rows, n = q.shape
    grouped = q.to(torch.int32).view(rows, n // 8, 8)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (grouped << shifts).sum(dim=2, dtype=torch.int32)


def test_column_packing_round_trips_in_awq_order():
    q = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    assert torch.equal(unpack_columns(pack_columns(q, AWQ_ORDER), AWQ_ORDER), q)
    word = int(pack_columns(q, AWQ_ORDER)[0, 0])
    assert (word >> 4) & 0xF == int(q[0, 2])  # AWQ's nibble 1 is column 2


def _rewrite(src: Path, dst: Path, convert, quantization_config: dict) -> Path:
    """A copy of the checkpoint ``src`` whose projection weights ``convert`` replaces
    (name prefix, weight) -> {name: tensor}; returns the dense equivalent's dir too."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        out = {}
        for name, tensor in tensors.items():
            prefix = name.removesuffix(".weight")
            if name.endswith(".weight") and prefix.split(".")[-1] in PROJECTIONS:
                out.update(convert(prefix, tensor))
            else:
                out[name] = tensor
        save_file(out, str(path))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _dense_twin(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> Path:
    """``src`` with the projections replaced by their dequantized values (16-bit)."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name in list(tensors):
            if name.removesuffix(".weight") in dequantized:
                tensors[name] = dequantized[name.removesuffix(".weight")]
        save_file(tensors, str(path))
    return dst


def _tokens(model_dir: Path, quant: str) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", quant=quant)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.fixture
def allocations(monkeypatch) -> list:
    """The ``Linear`` layers whose deferred dense weight the loader allocated (the
    engine streams its weight methods: a pre-quantized layer never needs one)."""
    from tokenloom.plugins.models.layers import Linear

    allocated: list = []
    real = Linear.materialize_weight

    def spy(self):
        before = self.weight.shape
        real(self)
        if self.weight.shape != before:
            allocated.append(self)

    monkeypatch.setattr(Linear, "materialize_weight", spy)
    return allocated


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _fp8_convert(stored: dict[str, torch.Tensor]):
    """The ``_rewrite`` conversion into an fp8 checkpoint's tensors (per-tensor scales);
    the dequantized weights go into ``stored``."""

    def convert(prefix, w):
        scale = w.float().abs().max() / 448.0
        q = (w.float() / scale).to(torch.float8_e4m3fn)
        stored[prefix] = q.float() * scale
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.reshape(())}

    return convert


def test_fp8_checkpoint_loads_its_weights_and_per_tensor_scales(tiny, tmp_path, allocations):
    stored: dict[str, torch.Tensor] = {}
    fp8_dir = _rewrite(tiny, tmp_path / "fp8", _fp8_convert(stored), FP8_CONFIG)
    llm = LLM(str(fp8_dir), dtype="float32", quant="fp8")
    try:
        attn = llm.engine.executor.model.model.layers[0].self_attn
        kernel = attn.qkv_proj.kernel
        # each part keeps its own scale; on the engine's device (CUDA where present)
        loaded = (kernel.weight.float() * kernel.scales).cpu()
        prefix = "model.layers.0.self_attn"
        expected = torch.cat([stored[f"{prefix}.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(loaded, expected)
        assert attn.qkv_proj.weight.numel() == 0
        assert allocations == []  # no layer held a dense weight, even for a moment
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()


def _int4_parts(w: torch.Tensor, group: int):
    qweight, scales, zeros = quantize_int4(w.half(), group)
    zeros = zeros.round()  # these formats store integer zero points
    q = unpack_int4(qweight)  # [K, N]
    deq = dequantize_int4(qweight, scales, zeros, group, torch.float32).contiguous()
    return q, scales, zeros.to(torch.int32), deq


def _ct_int4_parts(w: torch.Tensor, group: int, symmetric: bool):
    """compressed-tensors' W4A16 tensors of ``w [N, K]`` and their dequantized values:
    codes stored plus 8, zero points (asymmetric) packed along the outputs."""
    if symmetric:  # q in -8..7 about 0, one float16 scale a group
        n, k = w.shape
        g = w.float().view(n, k // group, group)
        scales = (g.abs().amax(dim=2) / 7).clamp(min=1e-8).half()  # [N, G]
        q = (g / scales.float()[..., None]).round().clamp(-8, 7)
        deq = (q * scales.float()[..., None]).view(n, k)
        stored, zeros = (q + 8).view(n, k).to(torch.int32), None
    else:  # int4's own RTN: unsigned codes and zero points are the stored ones
        q, scales_gn, zeros_gn, deq = _int4_parts(w, group)
        stored, scales, zeros = q.t().contiguous(), scales_gn.t(), zeros_gn.t().contiguous()
    tensors = {
        "weight_packed": pack_columns(stored, tuple(range(8))),  # [N, K / 8]
        "weight_scale": scales.contiguous(),  # [N, G]
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }
    if zeros is not None:  # [N, G] -> [N / 8, G], row 8 r + j in nibble j
        tensors["weight_zero_point"] = (
            pack_columns(zeros.t().contiguous(), tuple(range(8))).t().contiguous()
        )
    return tensors, deq


def _act_order_convert(method: str, group: int, dequantized: dict):
    """``gptq-act`` / ``ct-act``: act-order checkpoints. Each input size gets one fixed
    scatter (merged parts share their input, so their g_idx agree): the groups are runs
    of ``group`` in a random order of the inputs, input ``order[i]`` in group ``i // group``."""
    from tokenloom.plugins.quant.int4_checkpoints import unpack_columns

    def convert(prefix, w):
        k = w.shape[1]
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        inverse = torch.argsort(order)
        g_idx = (torch.arange(k) // group)[inverse].to(torch.int32)
        if method == "ct-act":
            tensors, deq = _ct_int4_parts(w[:, order], group, True)
            codes = unpack_columns(tensors["weight_packed"], tuple(range(8)))[:, inverse]
            tensors |= {"weight_packed": pack_columns(codes, tuple(range(8)))}
            tensors["weight_g_idx"] = g_idx
        else:
            q, scales, zeros, deq = _int4_parts(w[:, order], group)
            q = q[inverse]
            packed = (q.view(k // 8, 8, -1) << (torch.arange(8)[None, :, None] * 4)).sum(1)
            tensors = {
                "qweight": packed.to(torch.int32),
                "qzeros": pack_columns((zeros - 1) & 0xF, tuple(range(8))),
                "scales": scales,
                "g_idx": g_idx,
            }
        dequantized[prefix] = deq[:, inverse].contiguous()
        return {f"{prefix}.{key}": t for key, t in tensors.items()}

    return convert


def _int4_convert(method: str, group: int, skipped: list, dequantized: dict):
    """The ``_rewrite`` conversion into an AWQ, GPTQ or compressed-tensors (``ct``:
    symmetric, ``ct-asym``: zero points) checkpoint's tensors, or an act-order one
    (``gptq-act``, ``ct-act``); the dequantized weights go into ``dequantized``."""
    if method.endswith("-act"):
        return _act_order_convert(method, group, dequantized)

    def convert(prefix, w):
        if prefix.split(".")[-1] in skipped:  # modules_to_not_convert: stored 16-bit
            return {f"{prefix}.weight": w}
        if method.startswith("ct"):
            tensors, dequantized[prefix] = _ct_int4_parts(w, group, method == "ct")
            return {f"{prefix}.{key}": t for key, t in tensors.items()}
        q, scales, zeros, deq = _int4_parts(w, group)
        dequantized[prefix] = deq
        if method == "awq":
            return {
                f"{prefix}.qweight": pack_columns(q, AWQ_ORDER),
                f"{prefix}.qzeros": pack_columns(zeros, AWQ_ORDER),
                f"{prefix}.scales": scales,
            }
        k = q.shape[0]
        packed = (q.view(k // 8, 8, -1) << (torch.arange(8)[None, :, None] * 4)).sum(1)
        return {
            f"{prefix}.qweight": packed.to(torch.int32),
            f"{prefix}.qzeros": pack_columns((zeros - 1) & 0xF, tuple(range(8))),  # v1: z - 1
            f"{prefix}.scales": scales,
            f"{prefix}.g_idx": (torch.arange(k) // group).to(torch.int32),
        }

    return convert


def _ct_config(weights: dict, activations: dict | None = None, **extra) -> dict:
    """A compressed-tensors ``quantization_config`` of one scheme for every Linear."""
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    fmt = extra.pop("format", None) or (
        "float-quantized" if weights["type"] == "float" else "pack-quantized"
    )
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed"}
    return qc | {"config_groups": {"group_0": scheme}, "ignore": ["lm_head"]} | extra


def _int4_config(method: str, group: int, skipped: list) -> dict:
    if method.startswith("ct"):
        weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": group}
        actorder = "group" if method == "ct-act" else None
        weights |= {"symmetric": method != "ct-asym", "actorder": actorder, "observer": "minmax"}
        return _ct_config(weights, ignore=["lm_head"] + [f"re:.*{m}$" for m in skipped])
    qc = {"quant_method": method.removesuffix("-act"), "bits": 4, "group_size": group}
    qc["modules_to_not_convert"] = skipped
    desc_act = {"desc_act": method == "gptq-act"}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else desc_act)
    return qc


@pytest.mark.parametrize(
    ("method", "skipped"),
    [
        ("awq", []),
        ("gptq", []),
        ("awq", ["down_proj"]),
        ("ct", []),
        ("ct-asym", ["down_proj"]),
        ("gptq-act", []),
        ("ct-act", []),
    ],
)
def test_int4_checkpoint_generates_as_its_dense_twin(method, skipped, tiny, tmp_path, allocations):
    group = 32  # the tiny model's K (64, 128) holds several groups
    dequantized: dict[str, torch.Tensor] = {}
    convert = _int4_convert(method, group, skipped, dequantized)
    quantized = _rewrite(tiny, tmp_path / method, convert, _int4_config(method, group, skipped))
    twin = _dense_twin(tiny, tmp_path / "dense", dequantized)
    assert _tokens(quantized, "int4") == _tokens(twin, "none")
    if method.endswith("-act"):  # the groups gathered, the inputs gathered at each call
        from tokenloom.plugins.quant.common import PermutedInputKernel

        llm = LLM(str(quantized), dtype="float32", quant="int4")
        try:
            down = llm.engine.executor.model.model.layers[0].mlp.down_proj
            assert isinstance(down.kernel, PermutedInputKernel)
            x = torch.randn(3, down.in_features, device=down.input_perm.device)
            want = x.cpu() @ dequantized["model.layers.0.mlp.down_proj"].t()
            torch.testing.assert_close(down.kernel.apply(x, None).cpu(), want)
        finally:
            llm.engine.shutdown()
    if skipped:
        allocations.clear()
        llm = LLM(str(quantized), dtype="float32", quant="int4")
        try:
            # the layers the checkpoint left 16-bit, and only they, got dense weights
            model = llm.engine.executor.model
            assert {id(m) for m in allocations} == {
                id(layer.mlp.down_proj) for layer in model.model.layers
            }
            mlp = llm.engine.executor.model.model.layers[0].mlp
            assert mlp.down_proj.kernel is None and mlp.down_proj.weight.numel() > 0
            assert mlp.gate_up_proj.kernel is not None
        finally:
            llm.engine.shutdown()


def test_act_order_gptq_is_refused_on_a_shard_of_the_inputs(tiny, tmp_path):
    # a row-parallel rank's inputs hold a part of every act-order group
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.models import parallel
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.int4 import Int4Quant

    class RankOf(parallel.ParallelGroup):
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

    convert = _int4_convert("gptq-act", 32, [], {})
    path = _rewrite(tiny, tmp_path / "gptq-act", convert, _int4_config("gptq-act", 32, []))
    quant = Int4Quant(EngineConfig(quant="int4"))
    with (
        parallel.use(RankOf(0, 2)),
        pytest.raises(ValueError, match="act-order g_idx on a shard of the inputs"),
    ):
        load_model(
            path, torch.float32, "cpu", prepare=quant.prepare_model, loaded=quant.layer_loaded
        )


def test_block_wise_fp8_checkpoint_loads_requantized_per_channel(tiny, tmp_path):
    stored: dict[str, torch.Tensor] = {}

    def convert(prefix, w):
        n, k = w.shape
        blocks = w.float().view(n // 32, 32, k // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [N / 32, K / 32]
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        q = (w.float() / full).to(torch.float8_e4m3fn)
        stored[prefix] = q.float() * full
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale}

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    llm = LLM(str(_rewrite(tiny, tmp_path / "fp8b", convert, qc)), dtype="float32", quant="fp8")
    try:
        mlp = llm.engine.executor.model.model.layers[1].mlp
        kernel = mlp.gate_up_proj.kernel
        loaded = (kernel.weight.float() * kernel.scales).cpu()  # CUDA where present
        prefix = "model.layers.1.mlp"
        expected = torch.cat([stored[f"{prefix}.gate_proj"], stored[f"{prefix}.up_proj"]])
        row_max = expected.abs().amax(dim=1, keepdim=True)
        assert bool(((loaded - expected).abs() <= row_max * 2**-4).all())
        assert not hasattr(mlp.gate_up_proj, "block_scales")  # freed after requantizing
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["gptq", "awq", "ct-asym"])
def test_int4_checkpoint_shards_over_two_ranks(method, tiny, tmp_path):
    # each rank's kernels hold its slice of the checkpoint: row-parallel layers (o, down)
    # a range of K, which GPTQ's g_idx check must read from the shard's first row
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.models import parallel
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.int4 import Int4Quant

    class RankOf(parallel.ParallelGroup):
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

    dequantized: dict[str, torch.Tensor] = {}
    convert = _int4_convert(method, 32, [], dequantized)
    path = _rewrite(tiny, tmp_path / method, convert, _int4_config(method, 32, []))
    full = dequantized["model.layers.0.mlp.down_proj"]  # [N, K]
    for rank in (0, 1):
        quant = Int4Quant(EngineConfig(quant="int4"))
        with parallel.use(RankOf(rank, 2)):
            model, _ = load_model(
                path, torch.float32, "cpu", prepare=quant.prepare_model, loaded=quant.layer_loaded
            )
        quant.quantize_model(model)
        down = model.model.layers[0].mlp.down_proj
        lo, hi = down.in_range
        assert (lo, hi) == (rank * full.shape[1] // 2, (rank + 1) * full.shape[1] // 2)
        k = down.kernel
        got = dequantize_int4(k.qweight, k.scales, k.zeros, k.group, torch.float32)
        assert torch.equal(got, full[:, lo:hi])


@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq", "ct", "ct-fp8", "ct-int8"])
def test_a_quantized_checkpoint_loads_with_its_own_method_when_quant_is_left_none(
    fmt, tiny, tmp_path
):
    """``quant = "none"`` (the default) on a checkpoint whose config.json names its
    format serves it with the method that loads that format, token for token as when
    the method is named; ``tokenloom plan`` counts it the same way."""
    from tokenloom.config import load_config
    from tokenloom.entrypoints.plan import make_plan

    if fmt == "fp8":
        convert, qc, method = _fp8_convert({}), FP8_CONFIG, "fp8"
    elif fmt == "ct-fp8":
        convert, qc, method = _ct_fp8_convert("channel", {}), _ct_fp8_config("channel"), "fp8"
    elif fmt == "ct-int8":
        convert, qc, method = _ct_int8_convert(True, {}), _ct_int8_config(True), "int8"
    else:
        convert, qc, method = _int4_convert(fmt, 32, [], {}), _int4_config(fmt, 32, []), "int4"
    quantized = _rewrite(tiny, tmp_path / fmt, convert, qc)
    llm = LLM(str(quantized), dtype="float32")
    try:
        assert llm.engine.config.quant == method
        assert llm.engine.executor.model.model.layers[0].mlp.down_proj.kernel is not None
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        auto = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert auto == _tokens(quantized, method)
    plan = make_plan(load_config(model=str(quantized), dtype="float32"), gpu_memory_gb=16)
    assert plan.quant == method


def test_a_checkpoint_in_a_format_no_method_loads_is_refused_by_name(tiny, tmp_path):
    from tokenloom.config import ConfigError

    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    quantized = _rewrite(tiny, tmp_path / "bnb", lambda p, w: {f"{p}.weight": w}, qc)
    with pytest.raises(ConfigError, match="'bitsandbytes'.*no registered quant method.*awq"):
        LLM(str(quantized), dtype="float32")


FP8_WEIGHTS = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
TOKEN_FP8 = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}


def _ct_fp8_config(strategy: str, activations: dict | None = TOKEN_FP8, **extra) -> dict:
    block = [32, 32] if strategy == "block" else None
    weights = FP8_WEIGHTS | {"strategy": strategy, "block_structure": block}
    return _ct_config(weights, activations, **extra)


def _ct_fp8_convert(strategy: str, stored: dict):
    """compressed-tensors' fp8 tensors of a projection, one scale per tensor, output
    channel or 32 x 32 block; the dequantized weights go into ``stored``."""
    from tokenloom.plugins.quant.fp8 import quantize_fp8_rows

    def convert(prefix, w):
        if strategy == "channel":  # the load-time quantization's own rounding
            q, scale = quantize_fp8_rows(w)
            full = scale
        elif strategy == "tensor":
            scale = (w.float().abs().max() / 448.0).reshape(1)
            full = scale
            q = (w.float() / scale).to(torch.float8_e4m3fn)
        else:
            n, k = w.shape
            scale = w.float().view(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
            q = (w.float() / full).to(torch.float8_e4m3fn)
        stored[prefix] = q.float() * full
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}

    return convert


@pytest.mark.parametrize(
    ("strategy", "activations"),
    [("channel", TOKEN_FP8), ("tensor", TOKEN_FP8 | {"strategy": "tensor", "dynamic": False}),
     ("block", None)],
)  # fmt: skip
def test_compressed_tensors_fp8_loads_each_strategy(strategy, activations, tiny, tmp_path):
    """Per channel: the very values of fp8 at load (the same tokens); per tensor: each
    part keeps its scale; per block: quantized again per channel. Static activation
    scales and a kv_cache_scheme's scales are read past; the LM head stays 16-bit."""
    stored: dict[str, torch.Tensor] = {}
    convert = _ct_fp8_convert(strategy, stored)
    static = activations is not None and not activations["dynamic"]

    def with_extras(prefix, w):
        out = convert(prefix, w)
        if static:
            out[f"{prefix}.input_scale"] = torch.ones(1)
        if prefix.endswith("k_proj"):  # a kv_cache_scheme's static scales
            attn = prefix.removesuffix(".k_proj")
            out |= {f"{attn}.k_scale": torch.ones(()), f"{attn}.v_scale": torch.ones(())}
        return out

    kv = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    qc = _ct_fp8_config(strategy, activations, kv_cache_scheme=kv)
    path = _rewrite(tiny, tmp_path / f"ct-{strategy}", with_extras, qc)
    llm = LLM(str(path), dtype="float32")  # quant left at none: the checkpoint says fp8
    try:
        assert llm.engine.config.quant == "fp8"
        mlp = llm.engine.executor.model.model.layers[1].mlp
        kernel = mlp.gate_up_proj.kernel
        loaded = (kernel.weight.float() * kernel.scales).cpu()
        prefix = "model.layers.1.mlp"
        expected = torch.cat([stored[f"{prefix}.gate_proj"], stored[f"{prefix}.up_proj"]])
        if strategy == "block":
            row_max = expected.abs().amax(dim=1, keepdim=True)
            assert bool(((loaded - expected).abs() <= row_max * 2**-4).all())
        else:
            assert torch.equal(loaded, expected)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert all(len(t) == 12 for t in tokens)
    if strategy == "channel":
        assert tokens == _tokens(tiny, "fp8")


def _ct_int8_config(packed: bool, activations: dict | None = None) -> dict:
    weights = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
    fmt = "pack-quantized" if packed else "int-quantized"
    return _ct_config(weights, activations, format=fmt)


def _ct_int8_convert(packed: bool, dequantized: dict):
    """compressed-tensors' int8 tensors (per output channel, symmetric): four bytes a
    word plus 128 (pack-quantized) or int8 as is (int-quantized)."""

    def convert(prefix, w):
        n, k = w.shape
        scale = (w.float().abs().amax(dim=1, keepdim=True) / 127).half()  # [N, 1]
        q = (w.float() / scale.float()).round().clamp(-128, 127)
        q[0, 0] = -128  # the format's whole range: int8 reads -128 too
        dequantized[prefix] = q * scale.float()
        out = {f"{prefix}.weight_scale": scale}
        if packed:
            u = (q + 128).to(torch.int64).view(n, k // 4, 4)
            words = (u << torch.arange(0, 32, 8)).sum(dim=2)
            out[f"{prefix}.weight_packed"] = words.to(torch.uint32).view(torch.int32)
            out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        else:
            out[f"{prefix}.weight"] = q.to(torch.int8)
        return out

    return convert


@pytest.mark.parametrize("packed", [True, False])
def test_compressed_tensors_int8_generates_as_its_dense_twin(packed, tiny, tmp_path):
    dequantized: dict[str, torch.Tensor] = {}
    qc = _ct_int8_config(packed, activations=TOKEN_FP8 | {"type": "int"})  # W8A8: served W8A16
    path = _rewrite(tiny, tmp_path / "ct-int8", _ct_int8_convert(packed, dequantized), qc)
    twin = _dense_twin(tiny, tmp_path / "dense", dequantized)
    # the LM head: 16-bit in both (int8 quantizes its head by default)
    llm = LLM(str(path), dtype="float32", quant="int8", quant_lm_head=False)
    try:
        kernel = llm.engine.executor.model.model.layers[0].self_attn.o_proj.kernel
        w = (kernel.qweight.t().float() * kernel.scales.t()).cpu()
        assert torch.equal(w, dequantized["model.layers.0.self_attn.o_proj"])
        assert int(kernel.qweight.min()) == -128
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    twin_llm = LLM(str(twin), dtype="float32")
    try:
        outs = twin_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert tokens == [list(o.outputs[0].token_ids) for o in outs]
    finally:
        twin_llm.engine.shutdown()


def test_compressed_tensors_schemes_no_method_serves_are_refused_by_name(tiny, tmp_path):
    from tokenloom.config import ConfigError

    def keep_dense(p, w):
        return {f"{p}.weight": w}

    w4a8 = _int4_config("ct", 32, [])
    w4a8["config_groups"]["group_0"]["input_activations"] = TOKEN_FP8 | {"type": "int"}
    mixed = _int4_config("ct", 32, [])
    mixed["config_groups"]["group_1"] = _ct_fp8_config("channel")["config_groups"]["group_0"]
    cases = [
        (w4a8, r"int 4-bit weights per group of 32, int 8-bit activations.*no method"),
        (mixed, "2 quantization schemes"),
    ]
    for i, (qc, message) in enumerate(cases):
        path = _rewrite(tiny, tmp_path / f"refused{i}", keep_dense, qc)
        with pytest.raises(ConfigError, match=message):
            LLM(str(path), dtype="float32")
    # a method named for another method's scheme says which one serves it
    path = _rewrite(tiny, tmp_path / "int4", keep_dense, _int4_config("ct", 32, []))
    with pytest.raises(Exception, match=r"--quant fp8: .*pack-quantized.*\(--quant int4\)"):
        LLM(str(path), dtype="float32", quant="fp8")


def test_compressed_tensors_int8_shards_over_two_ranks(tiny, tmp_path):
    # row-parallel layers (o, down) read a range of K's words; every rank reads whole
    # per-row scales
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.models import parallel
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.int8 import Int8Quant, dequantize_int8

    class RankOf(parallel.ParallelGroup):
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

    dequantized: dict[str, torch.Tensor] = {}
    path = _rewrite(
        tiny, tmp_path / "ct8", _ct_int8_convert(True, dequantized), _ct_int8_config(True)
    )
    for name in ("mlp.down_proj", "mlp.gate_up_proj"):
        for rank in (0, 1):
            quant = Int8Quant(EngineConfig(quant="int8"))
            with parallel.use(RankOf(rank, 2)):
                model, _ = load_model(
                    path,
                    torch.float32,
                    "cpu",
                    prepare=quant.prepare_model,
                    loaded=quant.layer_loaded,
                )
            quant.quantize_model(model)
            layer = model.model.layers[0].get_submodule(name)
            got = dequantize_int8(layer.kernel.qweight, layer.kernel.scales, torch.float32)
            if name == "mlp.down_proj":
                lo, hi = layer.in_range
                assert (
                    hi - lo == got.shape[1] < dequantized["model.layers.0.mlp.down_proj"].shape[1]
                )
                assert torch.equal(got, dequantized["model.layers.0.mlp.down_proj"][:, lo:hi])
            else:
                full = [dequantized[f"model.layers.0.mlp.{p}_proj"] for p in ("gate", "up")]
                half = full[0].shape[0] // 2
                rows = [w[rank * half : (rank + 1) * half] for w in full]
                assert torch.equal(got, torch.cat(rows))


def test_quant_lm_head_takes_the_checkpoint_s_own_method(tiny, tmp_path):
    """``--quant-lm-head`` needs a weight method: a quantized checkpoint's own, with
    ``quant`` left at none; a 16-bit model without ``--quant`` is refused."""
    from tokenloom.config import ConfigError

    with pytest.raises(ConfigError, match="quant_lm_head: needs a weight quantization method"):
        LLM(str(tiny), dtype="float32", quant_lm_head=True)
    qc = _ct_fp8_config("channel")
    path = _rewrite(tiny, tmp_path / "ct-fp8", _ct_fp8_convert("channel", {}), qc)
    llm = LLM(str(path), dtype="float32", quant_lm_head=True)
    try:
        assert llm.engine.config.quant == "fp8"
        assert llm.engine.executor.model.lm_head.logits_kernel is not None
    finally:
        llm.engine.shutdown()


def test_checkpoint_quant_asks_every_reader_and_plain_format_lists():
    """A reader that cannot serve a compressed-tensors scheme passes the question on (a
    third-party method that lists the format then gets it); a factory that only lists
    ``checkpoint_formats`` (no ``reads_checkpoint``) is still chosen by them."""
    from types import SimpleNamespace

    from tokenloom.plugins.quant.fp8 import Fp8Quant
    from tokenloom.plugins.quant.int4 import Int4Quant
    from tokenloom.plugins.quant.int8 import Int8Quant
    from tokenloom.protocols.components.quant import checkpoint_quant

    def exl2(config):  # a factory function, not a QuantMethod subclass
        raise AssertionError("not built here")

    def w4a8(config):
        raise AssertionError("not built here")

    exl2.checkpoint_formats = ("exl2",)
    w4a8.checkpoint_formats = ("compressed-tensors",)

    def plugins(*factories):
        comps = [
            SimpleNamespace(kind="quant", name=n, spec=SimpleNamespace(factory=f))
            for n, f in factories
        ]
        return SimpleNamespace(components=lambda: sorted(comps, key=lambda c: c.name))

    builtin = [("fp8", Fp8Quant), ("int4", Int4Quant), ("int8", Int8Quant)]
    qc = _int4_config("ct", 32, [])
    qc["config_groups"]["group_0"]["input_activations"] = TOKEN_FP8 | {"type": "int"}
    with pytest.raises(ValueError, match="no method here serves it"):
        checkpoint_quant({"quantization_config": qc}, plugins(*builtin))
    assert (
        checkpoint_quant({"quantization_config": qc}, plugins(*builtin, ("w4a8", w4a8))) == "w4a8"
    )
    exl2_config = {"quantization_config": {"quant_method": "exl2"}}
    assert checkpoint_quant(exl2_config, plugins(*builtin, ("exl2", exl2))) == "exl2"
    w4a16 = {"quantization_config": _int4_config("ct", 32, [])}
    assert checkpoint_quant(w4a16, plugins(*builtin, ("w4a8", w4a8))) == "int4"  # by name


@pytest.mark.parametrize("actorder", ["dynamic", True, "Group"])
def test_compressed_tensors_act_order_aliases_are_read_as_groups(actorder):
    from tokenloom.plugins.quant.compressed_tensors import Scheme

    qc = _int4_config("ct", 32, [])
    qc["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert Scheme.from_config(qc).act_order  # a weight_g_idx a layer part
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "weight"  # stores no g_idx
    assert not Scheme.from_config(qc).act_order


def test_compressed_tensors_scheme_defaults_follow_the_format():
    """A missing strategy is inferred from the group size, a missing ``dynamic`` means
    static, and a block size may be written "NxM"."""
    from tokenloom.plugins.quant.compressed_tensors import Scheme, static_inputs

    qc = _int4_config("ct", 32, [])
    del qc["config_groups"]["group_0"]["weights"]["strategy"]
    assert Scheme.from_config(qc).strategy == "group"
    fp8 = _ct_fp8_config("block", {"type": "float", "num_bits": 8, "strategy": "tensor"})
    fp8["config_groups"]["group_0"]["weights"]["block_structure"] = "32x32"
    scheme = Scheme.from_config(fp8)
    assert (scheme.block, scheme.method, static_inputs(scheme)) == (
        (32, 32),
        "fp8",
        ("input_scale",),
    )


def test_compressed_tensors_int8_w8a8_with_static_activations_loads(tiny, tmp_path):
    dequantized: dict[str, torch.Tensor] = {}
    convert = _ct_int8_convert(False, dequantized)

    def with_inputs(prefix, w):  # static, asymmetric activations: a scale and a zero point
        return convert(prefix, w) | {
            f"{prefix}.input_scale": torch.ones(1),
            f"{prefix}.input_zero_point": torch.zeros(1, dtype=torch.int8),
        }

    acts = {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    qc = _ct_int8_config(False, acts | {"symmetric": False})
    path = _rewrite(tiny, tmp_path / "w8a8", with_inputs, qc)
    twin = _dense_twin(tiny, tmp_path / "dense", dequantized)
    assert _tokens(path, "none") == _tokens(twin, "none")  # the head: 16-bit in both


def test_compressed_tensors_refusals_by_name(tiny, tmp_path):
    """A quantized LM head (ignore leaves it out), part of a merged layer ignored,
    sparsity, online transforms and a checkpoint not stored compressed: each refused
    with its reason, before any tensor is read."""
    from tokenloom.config import ConfigError

    def keep_dense(p, w):
        return {f"{p}.weight": w}

    head = _ct_fp8_config("channel", ignore=[])
    part = _ct_fp8_config("channel", ignore=["lm_head", "re:.*q_proj$"])
    sparse = _ct_fp8_config("channel", sparsity_config={"format": "sparse-24-bitmask"})
    transform = _ct_fp8_config("channel", transform_config={"config_groups": {"u": {}}})
    frozen = _ct_fp8_config("channel", quantization_status="frozen")
    cases = [
        (head, "quantizes lm_head"),
        (part, "leaves part of"),
        (sparse, "sparse weights"),
        (transform, "online transforms"),
        (frozen, "quantization_status 'frozen'"),
    ]
    for i, (qc, message) in enumerate(cases):
        path = _rewrite(tiny, tmp_path / f"r{i}", keep_dense, qc)
        with pytest.raises((ConfigError, ValueError), match=message):
            LLM(str(path), dtype="float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["ct", "ct-asym", "ct-act", "gptq-act"])
def test_int4_checkpoints_on_the_gpu_kernels(method, tiny_model_factory, tmp_path):
    """bf16 on the GPU: the checkpoint's words feed the Triton kernels (compressed-
    tensors' ``[N, K / 8]`` words as the row-major storage the one-row GEMV streams),
    every projection of a layer gives ``x W^T`` of its dequantized weight at 1 and 16
    rows, and the model generates in its CUDA graphs."""
    shape = {"hidden_size": 1024, "intermediate_size": 2048, "num_heads": 8, "num_kv_heads": 2}
    model = Path(tiny_model_factory("llama", **shape))
    dequantized: dict[str, torch.Tensor] = {}
    convert = _int4_convert(method, 128, [], dequantized)
    path = _rewrite(model, tmp_path / method, convert, _int4_config(method, 128, []))
    llm = LLM(str(path), dtype="bfloat16", quant="int4")
    try:
        layer = llm.engine.executor.model.model.layers[0]
        parts = {
            layer.self_attn.qkv_proj: ("self_attn", ("q_proj", "k_proj", "v_proj")),
            layer.self_attn.o_proj: ("self_attn", ("o_proj",)),
            layer.mlp.gate_up_proj: ("mlp", ("gate_proj", "up_proj")),
            layer.mlp.down_proj: ("mlp", ("down_proj",)),
        }
        for linear, (block, names) in parts.items():
            w = torch.cat([dequantized[f"model.layers.0.{block}.{n}"] for n in names]).cuda()
            kernel = getattr(linear.kernel, "inner", linear.kernel)
            assert kernel.configs is not None  # the Triton kernels, not the reference
            if method.startswith("ct"):
                assert kernel.qweight.t().is_contiguous()  # [N, K / 8] words, row-major
            for m in (1, 16):
                x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
                expected = x.double() @ w.double().t()
                y = linear.kernel.apply(x, None).double()
                assert float((y - expected).norm() / expected.norm()) < 1e-2, (names, m)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()
