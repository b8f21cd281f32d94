"""Calibrated quantization of a whole checkpoint, the pipeline behind ``tokenloom
quantize``: load the model in float32 on a device, round its decoder ``Linear`` layers
one decoder layer at a time on the outputs of the layers before them, already quantized
(GPTQ, ``plugins.quant.calibration``, or learned rounding, ``plugins.quant.signround``;
AWQ's scaling first, ``plugins.quant.awq``), optionally tune the scales end to end
(``plugins.quant.scale_tuning``), and write the directory
(``plugins.quant.gptq_checkpoint``). The LM head and the embedding stay dense, as at
load-time quantization.

Every step runs on the device the model is loaded on (``device``: ``cpu``, the
reference, or ``cuda``); the teacher's next-token distributions of the scale tuning stay
in host memory and go to the device a pack at a time. The checkpoint is written from
host copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass
class LearnedRounding:
    """``--rounding learned``'s settings (``plugins.quant.signround.learn_layers``)."""

    iters: int = 200
    batch: int = 4
    target: Literal["float", "local"] = "float"
    per_token: bool = False
    head_kl: bool = False


@dataclass
class ScaleTuning:
    """``--tune-scales``'s settings (``plugins.quant.scale_tuning.tune_scales``)."""

    steps: int
    batch: int = 4
    lr: float = 1e-3
    norms: bool = True
    codes: float = 0.0


def quantize_checkpoint(
    model_path: str,
    method: str,
    out: Path,
    sequences: list[list[int]],
    group: int = 128,
    damping: float = 0.01,
    act_order: bool = False,
    dtype: Any = None,
    about: dict[str, Any] | None = None,
    awq: bool = False,
    awq_clip: bool = False,
    learned: LearnedRounding | None = None,
    tune: ScaleTuning | None = None,
    device: str = "cpu",
    fmt: str = "gptq",
) -> None:
    """Load ``model_path`` (directory or GGUF) in float32 on ``device``, GPTQ its
    decoder layers for ``method`` (int4 | fp8) calibrated on ``sequences``, write the
    checkpoint to ``out`` (dense tensors in ``dtype``, default float32). ``awq``
    (int4): AWQ-scale each layer first; ``awq_clip``: and clip its groups. ``learned``:
    learned rounding of each layer's output instead of GPTQ. ``tune``: then the
    scales trained end to end on the float model's next-token distributions. ``fmt``:
    of the checkpoint (``gptq_checkpoint.FORMATS``)."""
    import torch

    from tokenloom.plugins.models.gguf import find_gguf
    from tokenloom.plugins.models.loader import load_model, read_hf_config
    from tokenloom.plugins.quant.calibration import quantize_sequentially
    from tokenloom.plugins.quant.gptq import Fp8Grid, Grid, Int4Grid
    from tokenloom.plugins.quant.gptq_checkpoint import (
        checkpoint_tensors,
        quantization_config,
        write_checkpoint,
    )

    dtype = dtype or torch.float32
    gguf = find_gguf(model_path)
    if gguf is not None:
        from tokenloom.plugins.models.gguf.checkpoint import converted_dir

        source = converted_dir(gguf)
    else:
        source = Path(model_path)

    def make_grid() -> Grid:
        return Int4Grid(group, static=act_order) if method == "int4" else Fp8Grid()

    scaler = None
    if awq:
        from tokenloom.plugins.quant.awq import AwqScaler, int4_rtn

        if method != "int4":
            raise ValueError("AWQ is implemented for int4 only")
        scaler = AwqScaler(int4_rtn(group), clip_group=group if awq_clip else 0)
    started = time.perf_counter()
    model, _ = load_model(model_path, torch.float32, device)
    teacher = None
    if tune is not None:
        from tokenloom.plugins.quant.scale_tuning import teacher_log_probs, tune_scales

        teacher = teacher_log_probs(model, sequences, tune.batch)  # the float model's
    errors: dict[str, tuple[float, float]] = {}
    if learned is None:
        grids = quantize_sequentially(model, sequences, make_grid, damping, act_order, scaler)
    else:
        from tokenloom.plugins.quant.signround import learn_layers

        grids = learn_layers(
            model, sequences, method, group, learned.iters, learned.batch, learned.target,
            prepare_layer=scaler, record=errors, per_token=learned.per_token,
            head=(lambda x: model.compute_logits(model.model.norm(x))) if learned.head_kl else None,
            keep_latent=tune is not None and tune.codes > 0,
        )  # fmt: skip
    tuned: dict[str, Any] = {}
    if tune is not None and teacher is not None:
        rounded = time.perf_counter()
        kl = tune_scales(
            model, sequences, grids, teacher, tune.steps, tune.batch, tune.lr, tune.norms,
            tune.codes,
        )  # fmt: skip
        tuned = {
            "scale_tuning": {
                **vars(tune),
                "kl_before": kl[0],
                "kl_after": kl[1],
                "seconds": round(time.perf_counter() - rounded, 1),
            }
        }
    write_checkpoint(
        out,
        source,
        read_hf_config(source),
        checkpoint_tensors(model, grids, dtype, fmt),
        quantization_config(method, group, damping, fmt),
        dtype,
        {
            **(about or {}),
            "source": Path(model_path).name,
            "method": f"{'awq + ' if awq else ''}{'learned' if learned else 'gptq'} {method}"
            + (" + tuned scales" if tune else ""),
            "calibration_tokens": sum(len(s) for s in sequences),
            **(
                {"learned": vars(learned), "layer_errors": errors}
                if learned
                else {
                    "damping": damping,
                    "act_order": act_order,
                    "sequential": "layer by layer, and Linear by Linear inside a layer",
                }
            ),
            "quantize_seconds": round(time.perf_counter() - started, 1),
            "device": str(device),
            **(_awq_record(scaler) if scaler else {}),
            **tuned,
        },
    )


def _awq_record(scaler: Any) -> dict[str, Any]:
    """What AWQ chose, for quantize.json."""
    record = {"awq_alpha": scaler.alphas, "awq_error_vs_rtn": scaler.gains}
    if scaler.clip_group:
        record["awq_mean_clip_ratio"] = scaler.clips
    return record


__all__ = ["LearnedRounding", "ScaleTuning", "quantize_checkpoint"]
