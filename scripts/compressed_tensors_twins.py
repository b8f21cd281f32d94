"""Real-model compressed-tensors checkpoints for the readers' end-to-end check (session 45).

    python scripts/compressed_tensors_twins.py SRC OUT

SRC: an fp8 checkpoint of `tokenloom quantize --method fp8` (fbgemm_fp8, one scale per
channel). Writes under OUT: ct-fp8 (the same tensors under a compressed-tensors config),
dense (their dequantized float32 values), ct-int4 (the RTN codes int4 makes at load from
dense, groups of 128 with zero points, float32 scales) and ct-int8 (int8's codes at load,
packed). Each compressed-tensors checkpoint must evaluate exactly as its reference:
`tokenloom eval OUT/ct-X` against SRC (fp8) or `OUT/dense --quant int4|int8`.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenloom.plugins.quant.gptq_checkpoint import compressed_tensors_config
from tokenloom.plugins.quant.int4 import quantize_int4
from tokenloom.plugins.quant.int4_pack import unpack_int4
from tokenloom.plugins.quant.int8 import quantize_int8

TOKEN_FP8 = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` values 0..15 -> ``[R, C / 8]`` int32, column ``8 c + j`` in nibble ``j``."""
    r, c = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (q.to(torch.int32).view(r, c // 8, 8) << shifts).sum(2, dtype=torch.int32)


def write(src: Path, out: Path, tensors: dict, qc: dict | None) -> None:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    tensors = load_file(src / "model.safetensors")
    fp8 = torch.float8_e4m3fn
    proj = [n.removesuffix(".weight") for n, t in tensors.items() if t.dtype == fp8]
    print(len(proj), "fp8 projections")
    fp8_weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}
    write(
        src,
        out / "ct-fp8",
        dict(tensors),
        compressed_tensors_config(fp8_weights, TOKEN_FP8, "float-quantized"),
    )
    dense = {n: t for n, t in tensors.items() if not n.endswith(".weight_scale")}
    for p in proj:
        dense[f"{p}.weight"] = tensors[f"{p}.weight"].float() * tensors[f"{p}.weight_scale"].float()
    write(src, out / "dense", dense, None)
    i4, i8 = dict(dense), dict(dense)
    for p in proj:
        w = dense.pop(f"{p}.weight")
        n, k = w.shape
        shape = torch.tensor([n, k], dtype=torch.int32)
        qw, scales, zeros = quantize_int4(w, 128)  # as int4 at load: float32 scales
        del i4[f"{p}.weight"], i8[f"{p}.weight"]
        i4[f"{p}.weight_packed"] = pack_cols(unpack_int4(qw).t().contiguous())
        i4[f"{p}.weight_scale"] = scales.t().contiguous()
        i4[f"{p}.weight_zero_point"] = pack_cols(zeros.round().to(torch.int32)).t().contiguous()
        i4[f"{p}.weight_shape"] = shape
        q8, scales8 = quantize_int8(w)  # [K, N] view of [N, K], [1, N]
        u = (q8.t().to(torch.int64) + 128).view(n, k // 4, 4)
        words = (u << torch.arange(0, 32, 8)).sum(2).to(torch.uint32).view(torch.int32)
        i8[f"{p}.weight_packed"] = words
        i8[f"{p}.weight_scale"] = scales8.t().contiguous()
        i8[f"{p}.weight_shape"] = shape
    int4_weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
    int4_weights["symmetric"] = False
    write(src, out / "ct-int4", i4, compressed_tensors_config(int4_weights, None, "pack-quantized"))
    int8_weights = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
    write(src, out / "ct-int8", i8, compressed_tensors_config(int8_weights, None, "pack-quantized"))


if __name__ == "__main__":
    main()
