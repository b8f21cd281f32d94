"""Profile the host side of single-stream decode steps (where the time between GPU
steps goes). Usage: python scripts/profile_step.py [MODEL_SHAPE] [STEPS]"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.model_shapes import write_shape_dir
from tokenloom.protocols.requests import GenerateRequest

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
llm = LLM(str(write_shape_dir(shape, tempfile.mkdtemp())), load_format="random", max_num_seqs=8)
engine = llm.engine
params = SamplingParams(temperature=0.0, max_tokens=4 * steps, ignore_eos=True)
engine.add_request(GenerateRequest("r", list(range(10, 138)), params))
for _ in range(20):
    engine.step()
started = time.perf_counter()
for _ in range(steps):
    engine.step()
print(f"ms per step: {(time.perf_counter() - started) / steps * 1e3:.3f}")
profile = cProfile.Profile()
profile.enable()
for _ in range(steps):
    engine.step()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(22)
