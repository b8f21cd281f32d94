"""Writing a GPTQ-quantized model as a Hugging Face style directory that the
existing readers load (``--quant int4`` / ``--quant fp8``).

- int4: the GPTQ format (``quant_method: gptq``, ``desc_act: false``, the classic
  ``checkpoint_format: gptq`` storing zero points minus one; ``Int4Grid`` keeps them
  in 1..15 so that every reader's ``+ 1`` is exact). Per projection ``qweight [K / 8,
  N]``, ``qzeros [G, N / 8]``, ``scales [G, N]`` float16, ``g_idx [K]`` (``k //
  group``), as ``plugins.quant.int4_checkpoints`` reads them.
- fp8: ``quant_method: fbgemm_fp8``, the format of fp8 weights with one scale per
  output channel and dynamic per-token activation scales (vLLM and transformers read
  it): per projection ``weight [N, K]`` e4m3 and ``weight_scale [N, 1]`` float32.

Or (``fmt="compressed-tensors"``) in the compressed-tensors format, as llm-compressor
writes it and ``plugins.quant.compressed_tensors`` reads it, the same codes and scales:

- int4: ``pack-quantized``, groups with zero points (``symmetric: false``, no
  activation order): per projection ``weight_packed [N, K / 8]`` (code ``8 c + j`` of a
  row in nibble ``j`` of word ``c``), ``weight_scale [N, G]`` float16,
  ``weight_zero_point [N / 8, G]`` (packed along the outputs, stored as they are) and
  ``weight_shape``.
- fp8: ``float-quantized``, one scale per output channel, activations dynamic per
  token: ``weight [N, K]`` e4m3 and ``weight_scale [N, 1]`` float32.

A merged layer (q/k/v, gate/up) is split back into its checkpoint projections by the
model's own ``checkpoint_slots``; every other tensor (embedding, norms, an untied LM
head) is written dense in ``dtype``. The tokenizer files are copied from the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenloom.plugins.quant.gptq import Fp8Grid, Grid, Int4Grid
from tokenloom.plugins.quant.int4_pack import PACK

FBGEMM_ACTIVATION_SCALE_UB = 1200.0  # the format's usual bound (read, not applied here)
FORMATS = ("gptq", "compressed-tensors")  # int4 as GPTQ and fp8 as fbgemm_fp8, or both as CT
METADATA_SKIPPED = ("config.json", "model.safetensors.index.json")


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` values 0..15 -> ``[R, N / 8]`` int32, nibble ``j`` of word ``c``
    holding column ``8 c + j`` (GPTQ's ``qzeros``; the inverse of
    ``int4_checkpoints.unpack_columns`` in natural order)."""
    rows, n = values.shape
    words = values.to(torch.int32).view(rows, n // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=values.device)
    return (words << shifts).sum(dim=2, dtype=torch.int32)  # bits never overlap


def quantization_config(
    method: str, group: int, damping: float, fmt: str = "gptq"
) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for ``method`` (int4 | fp8) in ``fmt``."""
    if fmt == "compressed-tensors":
        return _compressed_tensors_config(method, group)
    if method == "int4":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": False,
            "true_sequential": True,
            "damp_percent": damping,
            "checkpoint_format": "gptq",
            "modules_to_not_convert": [],
        }
    return {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": FBGEMM_ACTIVATION_SCALE_UB,
        "modules_to_not_convert": [],
    }


def _compressed_tensors_config(method: str, group: int) -> dict[str, Any]:
    if method == "int4":
        fmt, activations = "pack-quantized", None
        weights: dict[str, Any] = {"type": "int", "num_bits": 4, "strategy": "group"}
        weights |= {"group_size": group, "symmetric": False, "actorder": None}
    else:
        fmt = "float-quantized"
        weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}
        activations = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
        activations["symmetric"] = True
    return compressed_tensors_config(weights | {"dynamic": False}, activations, fmt)


def compressed_tensors_config(
    weights: dict[str, Any], activations: dict[str, Any] | None, fmt: str
) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config``: one scheme (``weights``,
    ``input_activations``) for every ``Linear`` but the LM head, stored ``fmt``."""
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _projection_tensors(
    prefix: str, grid: Grid, rows: slice, fmt: str = "gptq"
) -> dict[str, torch.Tensor]:
    if isinstance(grid, Int4Grid) and fmt == "compressed-tensors":
        assert grid.codes is not None
        _, scales, zeros = grid.packed()  # [G, N] float16, [G, N] int32 in 1..15
        codes = grid.codes[rows]  # [n, K]
        return {
            f"{prefix}.weight_packed": pack_columns(codes),
            f"{prefix}.weight_scale": scales[:, rows].t().contiguous(),
            f"{prefix}.weight_zero_point": pack_columns(zeros[:, rows]).t().contiguous(),
            f"{prefix}.weight_shape": torch.tensor(
                list(codes.shape), dtype=torch.int64, device="cpu"
            ),
        }
    if isinstance(grid, Int4Grid):
        qweight, scales, zeros = grid.packed()
        k = qweight.shape[0] * PACK
        return {
            f"{prefix}.qweight": qweight[:, rows].contiguous(),
            f"{prefix}.qzeros": pack_columns((zeros[:, rows] - 1) & 0xF),  # stored z - 1
            f"{prefix}.scales": scales[:, rows].contiguous(),
            f"{prefix}.g_idx": (torch.arange(k, device="cpu") // grid.group).to(torch.int32),
        }
    assert isinstance(grid, Fp8Grid) and grid.codes is not None and grid.scales is not None
    return {
        f"{prefix}.weight": grid.codes[rows].contiguous(),
        f"{prefix}.weight_scale": grid.scales[rows].contiguous(),
    }


def checkpoint_tensors(
    model: nn.Module, grids: dict[str, Grid], dtype: torch.dtype, fmt: str = "gptq"
) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized checkpoint in ``fmt`` (``FORMATS``), by its Hugging
    Face name, on the CPU."""
    layers = {id(module.weight): name for name, module in model.named_modules() if name in grids}
    tensors: dict[str, torch.Tensor] = {}
    for key, slot in model.checkpoint_slots().items():
        name = layers.get(id(slot.param))
        if name is not None and key.endswith(".weight"):
            prefix = key.removesuffix(".weight")
            rows = slice(slot.start, slot.stop)
            tensors.update(_projection_tensors(prefix, grids[name], rows, fmt))
        else:
            tensors[key] = slot.target().to(dtype).contiguous()
    return {key: t.cpu() for key, t in tensors.items()}  # written from host memory


def write_checkpoint(
    out: Path,
    source: Path,
    hf_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    quant_config: dict[str, Any],
    dtype: torch.dtype,
    about: dict[str, Any],
) -> None:
    """``out``: config.json (``hf_config`` plus ``quant_config``), model.safetensors,
    the tokenizer and generation files of ``source``, and ``quantize.json``
    (``about``: how it was made)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        metadata = path.suffix in (".json", ".txt", ".model", ".jinja")
        if path.is_file() and metadata and path.name not in METADATA_SKIPPED:
            shutil.copyfile(path, out / path.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        **hf_config,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "quantization_config": quant_config,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "quantize.json").write_text(json.dumps(about, indent=2) + "\n", encoding="utf-8")
