"""Time the calibration sampling of ``tokenloom quantize`` on the built-in model (float32,
the engine's torch attention, 2 CPU threads): ``python scripts/quant_sample_time.py
[COUNT]`` samples COUNT sequences of 256 tokens at seed 0 and prints the seconds, the
tokens a second and a hash of the sequences (the same on two trees: the same text;
session 49)."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from tokenloom.checkpoints.default_model import default_model
from tokenloom.plugins.quant.calibration import sample_calibration_tokens


def main(count: int) -> None:
    torch.set_num_threads(2)
    started = time.perf_counter()
    sequences = sample_calibration_tokens(default_model(), count * 256, 256, 0)
    seconds = time.perf_counter() - started
    tokens = sum(len(s) for s in sequences)
    digest = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()[:16]
    record = {"sequences": len(sequences), "seconds": round(seconds, 1)}
    record |= {"tokens_per_s": round(tokens / seconds, 1), "sha256": digest}
    print(json.dumps(record))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
