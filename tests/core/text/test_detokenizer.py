"""Incremental detokenization: streamed text equals the full decode, characters whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tokenloom.text.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "café déjà vu, naïve résumé",
    "日本語のテキストです。東京",
    "party 🎉🚀 time 👩‍👩‍👧 done",
    "mixed: é日🎉 and plain words",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_factory("llama"))


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detokenizer.add([token_id]) for token_id in ids]
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streamed_multibyte_text_equals_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Once upon a time")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)  # chars span tokens
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert pieces[-1] == ""  # nothing was left for flush


def test_adding_tokens_in_groups_gives_the_same_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXTS[3], add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) + detokenizer.flush() == MULTIBYTE_TEXTS[3]


def test_special_tokens_are_skipped_unless_asked_for(tokenizer: Tokenizer) -> None:
    special = tokenizer.all_special_ids[-1]
    ids = tokenizer.encode("hello", add_special_tokens=False) + [special]
    ids += tokenizer.encode(" world", add_special_tokens=False)
    skipped = "".join(stream(IncrementalDetokenizer(tokenizer, []), ids))
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids))
    assert skipped == "hello world" == tokenizer.decode(ids)
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) != skipped


def test_an_incomplete_character_is_held_back_until_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    cut = ids[:-1]  # stops inside the emoji's bytes
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detokenizer.add([t]) for t in cut)
    assert streamed.rstrip() == "ok" and REPLACEMENT_CHAR not in streamed
    final = streamed + detokenizer.flush()
    assert final == tokenizer.decode(cut) and final.endswith(REPLACEMENT_CHAR)


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window_whatever_the_length(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(MULTIBYTE_TEXTS) * 40, add_special_tokens=False)
    assert len(ids) > 1000
    streamed = "".join(stream(IncrementalDetokenizer(counting, list(range(3, 50))), ids))
    assert streamed == tokenizer.decode(ids)
    assert counting.longest <= 12


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_token_sequence_streams_to_its_full_decode(tokenizer: Tokenizer, data) -> None:
    first_ordinary = max(tokenizer.all_special_ids) + 1
    ids = data.draw(
        st.lists(st.integers(first_ordinary, tokenizer.vocab_size - 1), min_size=1, max_size=40)
    )
    pieces = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces[:-1])
