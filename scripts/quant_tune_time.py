"""Time ``tune_scales`` on the built-in model (float32, CPU, 2 threads):
``python scripts/quant_tune_time.py STEPS`` rounds every projection to nearest int4
(g128) on 8 random sequences of 128 tokens, tunes the scales and norms for STEPS packs
of 4, and prints the seconds, the KL before and after, and the process's peak RSS
(session 49: run on two trees to compare)."""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

from tokenloom.checkpoints.default_model import default_model
from tokenloom.plugins.models.loader import load_model
from tokenloom.plugins.quant.scale_tuning import teacher_log_probs, tune_scales
from tokenloom.plugins.quant.signround import learn_layers


def main(steps: int) -> None:
    torch.set_num_threads(2)
    model, _ = load_model(default_model(), torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 40000, (8, 128), generator=gen).tolist()
    teacher = teacher_log_probs(model, sequences, batch=4)
    grids = learn_layers(model, sequences, "int4", group=128, iters=0, batch=4)
    started = time.perf_counter()
    kl = tune_scales(model, sequences, grids, teacher, steps, batch=4, lr=1e-3, norms=True)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux
    print(json.dumps({"seconds": round(seconds, 2), "kl": kl, "peak_rss_gb": round(peak, 2)}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
