"""Writers of pre-quantized checkpoints for the loading tests (``test_checkpoints.py``,
``test_compressed_tensors.py``): each rewrites a tiny random model's projections into a
format's tensors and config, keeping their dequantized values, so that a test can
compare the loaded kernels, and the tokens generated, against a 16-bit twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenloom import LLM, SamplingParams
from tokenloom.plugins.models import parallel
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int4_checkpoints import AWQ_ORDER, unpack_columns
from tokenloom.plugins.quant.int4_pack import unpack_int4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42]]


def pack_columns(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, N]`` values 0..15 -> ``[R, N / 8]`` int32, nibble j = column 8c + order[j]."""
    rows, n = q.shape
    grouped = q.to(torch.int32).view(rows, n // 8, 8)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (grouped << shifts).sum(dim=2, dtype=torch.int32)


def rewrite(src: Path, dst: Path, convert, quantization_config: dict) -> Path:
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


def dense_twin(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> Path:
    """``src`` with the projections replaced by their dequantized values (16-bit)."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name in list(tensors):
            if name.removesuffix(".weight") in dequantized:
                tensors[name] = dequantized[name.removesuffix(".weight")]
        save_file(tensors, str(path))
    return dst


def greedy_tokens(model_dir: Path, quant: str) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", quant=quant)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def fp8_convert(stored: dict[str, torch.Tensor]):
    """The ``rewrite`` conversion into an fp8 checkpoint's tensors (per-tensor scales);
    the dequantized weights go into ``stored``."""

    def convert(prefix, w):
        scale = w.float().abs().max() / 448.0
        q = (w.float() / scale).to(torch.float8_e4m3fn)
        stored[prefix] = q.float() * scale
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.reshape(())}

    return convert


def int4_parts(w: torch.Tensor, group: int):
    qweight, scales, zeros = quantize_int4(w.half(), group)
    zeros = zeros.round()  # these formats store integer zero points
    q = unpack_int4(qweight)  # [K, N]
    deq = dequantize_int4(qweight, scales, zeros, group, torch.float32).contiguous()
    return q, scales, zeros.to(torch.int32), deq


def ct_int4_parts(w: torch.Tensor, group: int, symmetric: bool):
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
        q, scales_gn, zeros_gn, deq = int4_parts(w, group)
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


def act_order_convert(method: str, group: int, dequantized: dict):
    """``gptq-act`` / ``ct-act``: act-order checkpoints. Each input size gets one fixed
    scatter (merged parts share their input, so their g_idx agree): the groups are runs
    of ``group`` in a random order of the inputs, input ``order[i]`` in group ``i // group``."""

    def convert(prefix, w):
        k = w.shape[1]
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        inverse = torch.argsort(order)
        g_idx = (torch.arange(k) // group)[inverse].to(torch.int32)
        if method == "ct-act":
            tensors, deq = ct_int4_parts(w[:, order], group, True)
            codes = unpack_columns(tensors["weight_packed"], tuple(range(8)))[:, inverse]
            tensors |= {"weight_packed": pack_columns(codes, tuple(range(8)))}
            tensors["weight_g_idx"] = g_idx
        else:
            q, scales, zeros, deq = int4_parts(w[:, order], group)
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


def int4_convert(method: str, group: int, skipped: list, dequantized: dict):
    """The ``rewrite`` conversion into an AWQ, GPTQ or compressed-tensors (``ct``:
    symmetric, ``ct-asym``: zero points) checkpoint's tensors, or an act-order one
    (``gptq-act``, ``ct-act``); the dequantized weights go into ``dequantized``."""
    if method.endswith("-act"):
        return act_order_convert(method, group, dequantized)

    def convert(prefix, w):
        if prefix.split(".")[-1] in skipped:  # modules_to_not_convert: stored 16-bit
            return {f"{prefix}.weight": w}
        if method.startswith("ct"):
            tensors, dequantized[prefix] = ct_int4_parts(w, group, method == "ct")
            return {f"{prefix}.{key}": t for key, t in tensors.items()}
        q, scales, zeros, deq = int4_parts(w, group)
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


def ct_config(weights: dict, activations: dict | None = None, **extra) -> dict:
    """A compressed-tensors ``quantization_config`` of one scheme for every Linear."""
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    fmt = extra.pop("format", None) or (
        "float-quantized" if weights["type"] == "float" else "pack-quantized"
    )
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed"}
    return qc | {"config_groups": {"group_0": scheme}, "ignore": ["lm_head"]} | extra


def int4_config(method: str, group: int, skipped: list) -> dict:
    if method.startswith("ct"):
        weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": group}
        actorder = "group" if method == "ct-act" else None
        weights |= {"symmetric": method != "ct-asym", "actorder": actorder, "observer": "minmax"}
        return ct_config(weights, ignore=["lm_head"] + [f"re:.*{m}$" for m in skipped])
    qc = {"quant_method": method.removesuffix("-act"), "bits": 4, "group_size": group}
    qc["modules_to_not_convert"] = skipped
    desc_act = {"desc_act": method == "gptq-act"}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else desc_act)
    return qc


FP8_WEIGHTS = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
TOKEN_FP8 = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}


def ct_fp8_config(strategy: str, activations: dict | None = TOKEN_FP8, **extra) -> dict:
    block = [32, 32] if strategy == "block" else None
    weights = FP8_WEIGHTS | {"strategy": strategy, "block_structure": block}
    return ct_config(weights, activations, **extra)


def ct_fp8_convert(strategy: str, stored: dict):
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


def ct_int8_config(packed: bool, activations: dict | None = None) -> dict:
    weights = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
    fmt = "pack-quantized" if packed else "int-quantized"
    return ct_config(weights, activations, format=fmt)


def ct_int8_convert(packed: bool, dequantized: dict):
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


class RankOf(parallel.ParallelGroup):
    """Rank ``rank`` of ``size``, for the loader's shard of each layer (no processes)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def load_on_rank(path: Path, quant, rank: int, size: int = 2):
    """The model at ``path`` as rank ``rank`` of ``size`` loads it, ``quant`` (a weight
    method) preparing it and quantizing each layer as it loads."""
    with parallel.use(RankOf(rank, size)):
        model, _ = load_model(
            path, torch.float32, "cpu", prepare=quant.prepare_model, loaded=quant.layer_loaded
        )
    return model
