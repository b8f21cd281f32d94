"""What one step of ``tune_scales`` keeps for its backward pass at Llama-3-8B's shapes,
measured on the CPU: ``python scripts/quant_tune_memory.py [LAYERS] [BATCH] [LENGTH]``
writes a random checkpoint of LAYERS decoder layers of Llama-3-8B's shape (vocabulary
128,256), rounds its projections to nearest int4 (g128), runs one tuning step of BATCH
sequences of LENGTH tokens with the norms, and prints the distinct bytes autograd kept,
split into the codes (uint8), the vocabulary-wide tensors (logits and their softmax)
and the rest (the decoder layers' activations), and per decoder layer (session 49)."""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict

import torch

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.scale_tuning import teacher_log_probs, tune_scales
from tokenloom.plugins.quant.signround import learn_layers

VOCAB = 128256
SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_heads": 32, "num_kv_heads": 8}


def main(layers: int, batch: int, length: int) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(
            tmp, "llama", dtype="bfloat16", num_layers=layers, vocab_size=VOCAB,
            max_position_embeddings=max(1024, length), **SHAPE,
        )  # fmt: skip
        model, _ = load_model(path, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 40000, (batch, length), generator=gen).tolist()
    teacher = teacher_log_probs(model, sequences, batch=batch)
    grids = learn_layers(model, sequences, "int4", group=128, iters=0, batch=batch)
    kept: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kind = "codes" if t.dtype == torch.uint8 else "vocab" if VOCAB in t.shape else "layers"
        kept[t.untyped_storage().data_ptr()] = (kind, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tune_scales(model, sequences, grids, teacher, steps=1, batch=batch, norms=True)
    by_kind: dict[str, int] = defaultdict(int)
    for kind, size in kept.values():
        by_kind[kind] += size
    weights = sum(model.get_submodule(n).weight.numel() for n in grids)
    record = {
        "layers": layers,
        "tokens": batch * length,
        "quantized_weights": weights,
        "kept_bytes": dict(by_kind),
        "activations_per_layer_gb": round(by_kind["layers"] / layers / 1e9, 3),
        "vocab_gb": round(by_kind["vocab"] / 1e9, 3),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [2, 4, 256][len(args) :]))
