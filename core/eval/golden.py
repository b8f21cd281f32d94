"""The golden set: prompts with recorded greedy completions, and how a run scores
against them.

``data/prompts.json`` holds the prompts (``GoldenSet`` without recordings);
``data/golden.json`` is the same set recorded by ``tokenloom eval --record``: each
prompt with its token ids and greedy completion, plus the recording's model, config
and perplexity. The golden file is written one prompt per line, so a re-recording
reads as a short diff.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.protocols.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenloom.llm import LLM

KINDS = ("chat", "completion")


class GoldenPrompt(msgspec.Struct, omit_defaults=True):
    id: str
    kind: str  # "chat": messages through the chat template; "completion": raw prompt text
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    # recorded by --record:
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_text: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"golden prompt {self.id}: kind must be one of {KINDS}")
        if (self.messages is None) == (self.prompt is None):
            raise ValueError(f"golden prompt {self.id}: give messages (chat) or prompt, not both")


class GoldenSet(msgspec.Struct, omit_defaults=True):
    prompts: list[GoldenPrompt]
    about: str = ""
    max_tokens: int = 32  # new tokens per prompt, greedy, stopping at EOS
    # recorded by --record:
    model: str = ""
    config: dict[str, Any] = {}
    text_sha256: str = ""
    perplexity: float | None = None
    num_text_tokens: int = 0
    # each passage's summed nll and predicted tokens (the report's interval pairs them)
    passage_nlls: list[float] = []
    passage_tokens: list[int] = []

    @property
    def is_recorded(self) -> bool:
        return all(p.completion_token_ids is not None for p in self.prompts)


def load_golden(path: str | Path) -> GoldenSet:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=GoldenSet)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"golden file {path}: {exc}") from exc


def save_golden(path: str | Path, golden: GoldenSet) -> None:
    """Write ``golden`` as JSON: the header fields one per line, then one line per prompt."""
    data = msgspec.to_builtins(golden)
    prompts = data.pop("prompts")
    lines = ["{"]
    lines += [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in data.items()]
    lines.append('  "prompts": [')
    lines += [f"    {json.dumps(p, ensure_ascii=False)}," for p in prompts]
    lines[-1] = lines[-1].rstrip(",")
    lines += ["  ]", "}", ""]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


def encode_prompt(llm: LLM, prompt: GoldenPrompt) -> list[int]:
    """Token ids as ``LLM.chat`` (chat) or ``LLM.generate`` (completion) would build them."""
    if prompt.messages is not None:
        text = llm.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True)
        return llm.tokenizer.encode(text, add_special_tokens=False)
    assert prompt.prompt is not None
    return llm.tokenizer.encode(prompt.prompt)


@dataclass(slots=True)
class GoldenRun:
    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    completion_texts: list[str]
    seconds: float


def run_golden(llm: LLM, golden: GoldenSet) -> GoldenRun:
    """Every prompt greedily, ``golden.max_tokens`` new tokens at most, in one batch."""
    started = time.perf_counter()
    prompt_ids = [encode_prompt(llm, p) for p in golden.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=golden.max_tokens)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    return GoldenRun(
        prompt_token_ids=prompt_ids,
        completion_token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        completion_texts=[o.outputs[0].text for o in outputs],
        seconds=time.perf_counter() - started,
    )


def recorded(golden: GoldenSet, run: GoldenRun, **header: Any) -> GoldenSet:
    """``golden`` with ``run``'s completions recorded into it, and ``header`` fields set."""
    prompts = [
        msgspec.structs.replace(
            p, prompt_token_ids=ids, completion_token_ids=completion, completion_text=text
        )
        for p, ids, completion, text in zip(
            golden.prompts,
            run.prompt_token_ids,
            run.completion_token_ids,
            run.completion_texts,
            strict=True,
        )
    ]
    return msgspec.structs.replace(golden, prompts=prompts, **header)


@dataclass(slots=True)
class GoldenScores:
    """``exact_match_pct``: prompts whose completion equals the recorded one.
    ``token_agreement_pct``: recorded tokens reproduced before the first divergence,
    over all recorded tokens. ``per_prompt`` has one dict per prompt."""

    exact_match_pct: float
    token_agreement_pct: float
    num_exact: int
    num_agreed_tokens: int
    num_reference_tokens: int
    per_prompt: list[dict[str, Any]] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def score(golden: GoldenSet, run: GoldenRun) -> GoldenScores:
    """Compare ``run`` with the completions recorded in ``golden`` (same prompts, in order)."""
    if not golden.is_recorded:
        raise ValueError("the golden set has no recorded completions: record it with --record")
    per_prompt = []
    num_exact = agreed = total = 0
    for prompt, ids, out in zip(
        golden.prompts, run.prompt_token_ids, run.completion_token_ids, strict=True
    ):
        ref = prompt.completion_token_ids
        assert ref is not None
        prefix = common_prefix(ref, out)
        exact = ref == out
        num_exact += exact
        agreed += prefix
        total += len(ref)
        per_prompt.append(
            {
                "id": prompt.id,
                "exact": exact,
                "agreed_tokens": prefix,
                "reference_tokens": len(ref),
                "output_tokens": len(out),
                "same_prompt_tokens": ids == prompt.prompt_token_ids,
            }
        )
    num = len(golden.prompts)
    return GoldenScores(
        exact_match_pct=100.0 * num_exact / num if num else 0.0,
        token_agreement_pct=100.0 * agreed / total if total else 0.0,
        num_exact=num_exact,
        num_agreed_tokens=agreed,
        num_reference_tokens=total,
        per_prompt=per_prompt,
    )
