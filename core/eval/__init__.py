"""Quality evaluation: ``tokenloom eval`` compares one engine setup against a reference.

Two measurements, both through the public offline API (``tokenloom.LLM``), so any
engine config (dtype, attention backend, quantization, speculative decoding, ...)
runs through the same code:

- **Perplexity** (``perplexity.py``) of a fixed text (``data/text.txt``, one passage
  per paragraph): ``exp(total NLL / predicted tokens)``, where each passage's tokens
  after its first are predicted from the tokens before them. The per-token
  logprobs come from the engine itself (``SamplingParams.prompt_logprobs``), so they
  are exactly what the config under test computes, chunked prefill included.
  Against the golden file's recording, the change is reported with its 95% interval
  when the passages are resampled with replacement (paired: the same draw for both
  models), because a passage's tokens are not independent of one another.
- **Golden completions** (``golden.py``): the prompts of ``data/prompts.json``,
  recorded once with greedy decoding on the fp32 reference path into
  ``data/golden.json``, then replayed greedily under the config under test.
  *Exact match %* is the share of prompts whose whole completion (token ids) equals
  the recorded one. *Token agreement %* is the share of recorded completion tokens
  reproduced before the first divergence: ``sum_i common_prefix(ref_i, out_i) /
  sum_i len(ref_i)``. Greedy decoding depends on every earlier token, so positions
  after a divergence are not compared.

``report.py`` builds the JSON and the table; ``cli.py`` is the command.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
TEXT_PATH = DATA_DIR / "text.txt"
PROMPTS_PATH = DATA_DIR / "prompts.json"
GOLDEN_PATH = DATA_DIR / "golden.json"
