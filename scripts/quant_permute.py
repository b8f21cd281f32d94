"""Permute the built-in model's channels so that int4's groups of 128 gather columns of
like size, and write it as a dense float32 checkpoint (docs/quantization.md, "Session
42: channel permutations before int4").

    python scripts/quant_permute.py OUT [--mlp CRIT] [--stream CRIT]
    tokenloom eval OUT --quant int4 --dtype float32 --attention torch --device cpu

A permutation changes nothing in float and needs nothing at run time, unlike a rotation
(session 34), because an RMS norm commutes with it once its weight is permuted too:

- ``--mlp``: each layer's intermediate channels (rows of gate_proj and up_proj, columns
  of down_proj), chosen from down_proj's columns;
- ``--stream``: the residual stream's channels (columns of the embeddings, so of the
  tied LM head too; every norm's weight; columns of q/k/v and gate/up; rows of o_proj and
  down_proj), one permutation for the whole model, chosen from all its readers' columns.

CRIT orders the channels by a size of their columns: ``rms`` (root mean square over the
rows), ``max`` (largest magnitude), ``none`` (no permutation).

    python scripts/quant_permute.py --proxies

prints two transforms that keep the Q4_1 file's blocks of 32 whole, by int4 RTN's squared
weight error: down_proj's blocks reordered by their mean range (a group of 128 still
holds four whole blocks), and each projection's blocks scaled by the block term of
``log range[row, block] ~ row term + block term`` (what a per-channel scale can take out)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenloom.checkpoints.default_model import default_model
from tokenloom.plugins.models.gguf import find_gguf
from tokenloom.plugins.models.gguf.checkpoint import converted_dir

READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITES = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def column_size(w: torch.Tensor, crit: str) -> torch.Tensor:
    """A size per column of ``w`` [N, K], relative to the layer's (so that layers of
    different scales weigh alike when summed)."""
    if crit == "rms":
        size = w.pow(2).mean(0).sqrt()
    elif crit == "max":
        size = w.abs().amax(0)
    else:
        raise ValueError(crit)
    return size / size.mean()


def order(sizes: list[torch.Tensor]) -> torch.Tensor:
    """Channels by decreasing summed size."""
    return torch.argsort(torch.stack(sizes).sum(0), descending=True)


def permute(sd: dict[str, torch.Tensor], layers: int, mlp: str, stream: str) -> dict:
    new = dict(sd)
    if mlp != "none":
        for i in range(layers):
            p = f"model.layers.{i}.mlp."
            perm = order([column_size(sd[p + "down_proj.weight"], mlp)])
            for n in ("gate_proj", "up_proj"):
                new[p + n + ".weight"] = sd[p + n + ".weight"][perm]
            new[p + "down_proj.weight"] = sd[p + "down_proj.weight"][:, perm]
    if stream != "none":
        sizes = [
            column_size(new[f"model.layers.{i}.{n}.weight"], stream)
            for i in range(layers)
            for n in READS
        ]
        perm = order(sizes)
        new["model.embed_tokens.weight"] = new["model.embed_tokens.weight"][:, perm]
        new["model.norm.weight"] = new["model.norm.weight"][perm]
        for i in range(layers):
            p = f"model.layers.{i}."
            for n in READS:
                new[p + n + ".weight"] = new[p + n + ".weight"][:, perm]
            for n in WRITES:
                new[p + n + ".weight"] = new[p + n + ".weight"][perm]
            for n in NORMS:
                new[p + n + ".weight"] = new[p + n + ".weight"][perm]
    return new


def rtn_error(w: torch.Tensor) -> torch.Tensor:
    """int4 RTN's squared error per weight, groups of 128 (``quantize_int4``)."""
    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4

    q, s, z = quantize_int4(w, 128)
    d = dequantize_int4(q, s, z, 128, torch.float32)
    return (d.T if d.shape != w.shape else d) - w


def proxies(sd: dict[str, torch.Tensor], layers: int) -> None:
    ordered = plain = 0.0
    for i in range(layers):
        w = sd[f"model.layers.{i}.mlp.down_proj.weight"]
        blocks = w.view(w.shape[0], -1, 32)
        order = torch.argsort((blocks.amax(2) - blocks.amin(2)).mean(0), descending=True)
        cols = (order[:, None] * 32 + torch.arange(32)).reshape(-1)
        plain += rtn_error(w).pow(2).sum().item()
        ordered += rtn_error(w[:, cols]).pow(2).sum().item()
    print(f"down_proj, blocks by mean range: {ordered / plain:.4f}x the RTN error")
    for name in (*READS[:3], "self_attn.o_proj", *READS[3:], "mlp.down_proj"):
        before = after = 0.0
        for i in range(layers):
            w = sd[f"model.layers.{i}.{name}.weight"].double()
            blocks = w.view(w.shape[0], -1, 32)
            logs = (blocks.amax(2) - blocks.amin(2)).clamp(min=1e-12).log()
            col = logs.mean(0, keepdim=True)
            scale = (col - col.mean()).exp().repeat_interleave(32, dim=1)
            before += rtn_error(w.float()).pow(2).sum().item()
            after += (rtn_error((w / scale).float()).double().pow(2) * scale**2).sum().item()
        print(f"{name}, blocks scaled by their block term: {after / before:.4f}x the RTN error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--proxies", action="store_true")
    parser.add_argument("--mlp", default="rms", choices=("none", "rms", "max"))
    parser.add_argument("--stream", default="none", choices=("none", "rms", "max"))
    args = parser.parse_args()
    src = converted_dir(find_gguf(default_model()))
    sd = load_file(str(src / "model.float32.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if args.proxies:
        proxies(sd, cfg["num_hidden_layers"])
        return
    if args.out is None:
        parser.error("OUT is needed unless --proxies")
    new = permute(sd, cfg["num_hidden_layers"], args.mlp, args.stream)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in new.items()}, str(args.out / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, args.out / f)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
