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
from tokenloom.plugins.quant.int4 import PACK

FBGEMM_ACTIVATION_SCALE_UB = 1200.0  # the format's usual bound (read, not applied here)
METADATA_SKIPPED = ("config.json", "model.safetensors.index.json")


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` values 0..15 -> ``[R, N / 8]`` int32, nibble ``j`` of word ``c``
    holding column ``8 c + j`` (GPTQ's ``qzeros``; the inverse of
    ``int4_checkpoints.unpack_columns`` in natural order)."""
    rows, n = values.shape
    words = values.to(torch.int32).view(rows, n // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=values.device)
    return (words << shifts).sum(dim=2, dtype=torch.int32)  # bits never overlap


def quantization_config(method: str, group: int, damping: float) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for ``method`` (int4 | fp8)."""
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


def _projection_tensors(prefix: str, grid: Grid, rows: slice) -> dict[str, torch.Tensor]:
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
    model: nn.Module, grids: dict[str, Grid], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized checkpoint, by its Hugging Face name, on the CPU."""
    layers = {id(module.weight): name for name, module in model.named_modules() if name in grids}
    tensors: dict[str, torch.Tensor] = {}
    for key, slot in model.checkpoint_slots().items():
        name = layers.get(id(slot.param))
        if name is not None and key.endswith(".weight"):
            prefix = key.removesuffix(".weight")
            tensors.update(_projection_tensors(prefix, grids[name], slice(slot.start, slot.stop)))
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
