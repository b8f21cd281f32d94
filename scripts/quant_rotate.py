"""Fold a rotation of the residual stream into the built-in model (SpinQuant's R1) and
write it as a dense float32 checkpoint, for measuring int4 after a rotation
(docs/quantization.md, "Session 34: a rotation of the residual stream").

    python scripts/quant_rotate.py OUT [--seed N]     # --seed -1: the folds only, R = I
    tokenloom eval OUT --quant int4 --dtype float32 --attention torch --device cpu

Every RMS norm's weight is folded into the linears it feeds (and set to 1), the LM head
is untied from the embeddings, and an orthogonal R (QR of a Gaussian) enters the
embeddings (E R), every linear that reads the stream (W diag(g) R, g the norm before it)
and every one that writes it (R^T W); the LM head becomes E diag(g_final) R. For a
checkpoint with tied embeddings, as the built-in model's."""

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

READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
READS_MLP = ("mlp.gate_proj", "mlp.up_proj")
WRITES = ("self_attn.o_proj", "mlp.down_proj")


def rotation(dim: int, seed: int) -> torch.Tensor:
    if seed < 0:
        return torch.eye(dim, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    src = converted_dir(find_gguf(default_model()))
    sd = {k: v.double() for k, v in load_file(str(src / "model.float32.safetensors")).items()}
    cfg = json.loads((src / "config.json").read_text())
    dim = cfg["hidden_size"]
    rot = rotation(dim, args.seed)
    ones = torch.ones(dim, dtype=torch.float64)
    emb = sd["model.embed_tokens.weight"]
    new = {
        "model.embed_tokens.weight": emb @ rot,
        "lm_head.weight": (emb * sd["model.norm.weight"]) @ rot,
        "model.norm.weight": ones,
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for names, norm in ((READS, "input_layernorm"), (READS_MLP, "post_attention_layernorm")):
            for n in names:
                new[p + n + ".weight"] = (sd[p + n + ".weight"] * sd[p + norm + ".weight"]) @ rot
            new[p + norm + ".weight"] = ones
        for n in WRITES:
            new[p + n + ".weight"] = rot.T @ sd[p + n + ".weight"]
    assert set(new) - {"lm_head.weight"} == set(sd), set(sd) ^ set(new)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.float().contiguous() for k, v in new.items()}, str(args.out / "model.safetensors")
    )
    cfg["tie_word_embeddings"] = False
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, args.out / f)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
