"""One evaluation: build the engine from a config, measure perplexity, replay (or
record) the golden set, and return the report (see ``report.py`` for its keys)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.eval import GOLDEN_PATH, PROMPTS_PATH, TEXT_PATH
from tokenloom.eval.golden import load_golden, recorded, run_golden, save_golden, score
from tokenloom.eval.perplexity import load_passages, measure_perplexity
from tokenloom.eval.report import build_report


def evaluate(
    config: EngineConfig,
    golden_path: str | Path = GOLDEN_PATH,
    text_path: str | Path = TEXT_PATH,
    record: bool = False,
    prompts_path: str | Path = PROMPTS_PATH,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Evaluate ``config`` against the golden file; with ``record``, first rewrite the
    golden file from this config (prompts from ``prompts_path``), so the run scores
    100% against itself and the file holds this config's perplexity as reference."""
    from tokenloom.llm import LLM

    started = time.perf_counter()
    reference = load_golden(prompts_path if record else golden_path)
    if max_tokens is not None:
        if not record:
            raise ValueError("max_tokens: only with record (the golden file fixes it)")
        reference = msgspec.structs.replace(reference, max_tokens=max_tokens)
    if not record and not reference.is_recorded:
        raise ValueError(f"{golden_path}: no recorded completions; record them with --record")
    text = Path(text_path).read_bytes()
    passages = load_passages(text_path)

    options = msgspec.structs.asdict(config)
    llm = LLM(model=options.pop("model"), **options)
    resolved = llm.engine.config
    model = Path(llm.engine.info.name).name
    loaded = time.perf_counter()

    ppl = measure_perplexity(llm, passages)
    run = run_golden(llm, reference)
    text_sha256 = hashlib.sha256(text).hexdigest()
    config_dict = {**msgspec.to_builtins(resolved), "model": model}
    if record:
        reference = recorded(
            reference,
            run,
            model=model,
            config=config_dict,
            text_sha256=text_sha256,
            perplexity=ppl.perplexity,
            num_text_tokens=ppl.num_tokens,
            passage_nlls=ppl.passage_nlls,
            passage_tokens=ppl.passage_tokens,
        )
        save_golden(golden_path, reference)
    scores = score(reference, run)
    llm.engine.shutdown()
    finished = time.perf_counter()
    import torch

    timings = {
        "threads": torch.get_num_threads(),
        "load_s": loaded - started,
        "perplexity_s": ppl.seconds,
        "golden_s": run.seconds,
        "total_s": finished - started,
    }
    return build_report(
        model=model,
        config=config_dict,
        reference=reference,
        golden_path=str(golden_path),
        text_sha256=text_sha256,
        perplexity=ppl,
        scores=scores,
        timings=timings,
        recorded=record,
    )
