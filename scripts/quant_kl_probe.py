"""How far a quantized checkpoint's next-token distributions are from the float model's,
on the calibration text it was fitted to and on text it never saw (issue 12).

    python scripts/quant_kl_probe.py CKPT [CKPT ...] [--seed 0] [--heldout-seed 256]
        [--text FILE ...] [--sequences 16] [--out F]

For each int4 checkpoint written by ``tokenloom quantize``: the mean KL divergence
(nats per token) from the built-in float model, over ``--sequences`` sequences of 256
tokens of each set: the calibration sample (``--seed``: what the checkpoint was fitted
on: its first ``--sequences``, which are drawn with seeds ``seed + i`` whatever the
sample's size), a held-out sample drawn the same way (``--heldout-seed``: seeds the
calibration did not use; ``tokenloom quantize`` uses ``seed`` to ``seed + count - 1``), and
windows of each ``--text`` (default: the eval text, which is a diagnostic only, and
docs/quantization.md). A large gap between the first and the rest is overfitting of
the calibration sample. fp32, CPU; the checkpoints' layers dequantized into a dense
copy of the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenloom import LLM
from tokenloom.checkpoints.default_model import default_model
from tokenloom.eval import TEXT_PATH
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.calibration import sample_calibration_tokens
from tokenloom.plugins.quant.int4 import dequantize_int4
from tokenloom.plugins.quant.scale_tuning import teacher_log_probs

LENGTH = 256


def text_windows(llm: LLM, path: Path, count: int) -> list[list[int]]:
    ids = llm.tokenizer.encode(path.read_text(), add_special_tokens=False)
    step = max(LENGTH, (len(ids) - LENGTH) // count)
    return [ids[i : i + LENGTH] for i in range(0, len(ids) - LENGTH, step)][:count]


def dense_copy(checkpoint: str) -> torch.nn.Module:
    """The float model with the checkpoint's int4 layers (dequantized) and norms."""
    model, _ = load_model(default_model(), torch.float32, "cpu")
    llm = LLM(checkpoint, dtype="float32", quant="int4", attention="torch", device="cpu")
    try:
        quantized = llm.engine.executor.model
        params = dict(quantized.named_parameters())
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, Linear) and name.startswith("model.layers."):
                    k = quantized.get_submodule(name).kernel
                    module.weight.copy_(
                        dequantize_int4(k.qweight, k.scales, k.zeros, k.group, torch.float32)
                    )
            for name, p in model.named_parameters():
                if "norm" in name:  # AWQ folds its scales into the norms
                    p.copy_(params[name])
    finally:
        llm.engine.shutdown()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-seed", type=int, default=256)
    parser.add_argument("--text", type=Path, nargs="*")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = args.text or [Path(TEXT_PATH), Path(__file__).parent.parent / "docs/quantization.md"]
    tokens = args.sequences * LENGTH
    sets = {
        "calibration": sample_calibration_tokens(default_model(), tokens, LENGTH, args.seed),
        "held-out sample": sample_calibration_tokens(
            default_model(), tokens, LENGTH, args.heldout_seed
        ),
    }
    llm = LLM(default_model(), dtype="float32", attention="torch", device="cpu")
    try:
        for path in texts:
            sets[path.name] = text_windows(llm, path, args.sequences)
    finally:
        llm.engine.shutdown()
    model, _ = load_model(default_model(), torch.float32, "cpu")
    reference = {name: teacher_log_probs(model, seqs) for name, seqs in sets.items()}
    results: dict[str, dict[str, float]] = {}
    for checkpoint in args.checkpoints:
        quantized = dense_copy(checkpoint)
        results[checkpoint] = {}
        for name, seqs in sets.items():
            logps = teacher_log_probs(quantized, seqs)
            kls = [
                F.kl_div(q.float(), r.float(), log_target=True, reduction="batchmean").item()
                for q, r in zip(logps, reference[name], strict=True)
            ]
            results[checkpoint][name] = round(sum(kls) / len(kls), 5)
        print(checkpoint, results[checkpoint], flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
