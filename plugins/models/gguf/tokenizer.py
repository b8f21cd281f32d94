"""The tokenizer a GGUF file describes, as tokenizer.json + tokenizer_config.json.

GGUF stores no tokenizer.json, only llama.cpp's description: ``tokenizer.ggml.model``
(``gpt2`` is byte-level BPE, the one supported here), the vocabulary, the merges,
each token's type (3: control, a special token; 4: user-defined, an added token that
is not special), the special ids, whether to add BOS/EOS, ``tokenizer.ggml.pre`` (the
pre-tokenizer the merges were learned with) and the chat template. ``tokenizer_files``
rebuilds the ``tokenizers`` backend from it, so tokenloom's ``Tokenizer`` loads the
result like any Hugging Face directory.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenloom.logging import get_logger
from tokenloom.plugins.models.gguf.metadata import UnsupportedGGUFError

log = get_logger(__name__)

CONTROL, USER_DEFINED = 3, 4

# Split regexes of llama.cpp's pre-tokenizers (``tokenizer.ggml.pre``) beyond GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GPT-2's split after isolating every digit (StarCoder's and SmolLM's vocabularies).
DIGIT_SPLIT = ("smollm", "starcoder", "refact", "codeshell")
GPT2_SPLIT = ("gpt2", "default", "gpt-2")


def tokenizer_files(metadata: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config dict) for a GGUF file's metadata.
    Raises UnsupportedGGUFError for a tokenizer model other than ``gpt2``."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"tokenizer.ggml.{name}", default)

    if key("model") != "gpt2":
        raise UnsupportedGGUFError(
            f"GGUF tokenizer model {key('model')!r} is not supported; supported: gpt2 "
            "(byte-level BPE)"
        )
    tokens: list[str] = list(key("tokens", []))
    types: list[int] = list(key("token_type", []))
    vocab = {byte_level_spelling(token): i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in key("merges", [])]
    backend = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(key("pre", "default"))
    backend.decoder = decoders.ByteLevel()
    alphabet = _byte_alphabet()
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            # a control token outside the byte alphabet is a mislabel: it is no real token
            for token, kind in zip(tokens, types, strict=False)
            if kind == CONTROL and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED and token in vocab
        ]
    )
    config = _tokenizer_config(metadata, tokens)
    post = _post_processor(config, tokens, key("bos_token_id"), key("eos_token_id"))
    if post is not None:
        backend.post_processor = post
    return backend.to_str(), config


def byte_level_spelling(token: str) -> str:
    """``token`` in the byte-level alphabet: unchanged when it is already spelled so,
    else its UTF-8 bytes mapped (files that store some tokens as plain text)."""
    alphabet = _byte_alphabet()
    if set(token) <= alphabet:
        return token
    table = _bytes_to_unicode()
    return "".join(table[byte] for byte in token.encode("utf-8"))


def _tokenizer_config(metadata: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in GPT2_SPLIT:
        log.warning("GGUF pre-tokenizer %r is unknown; splitting text as GPT-2 does", pre)
    return byte_level


def _post_processor(
    config: dict[str, Any], tokens: list[str], bos_id: int | None, eos_id: int | None
) -> Any:
    """BOS/EOS around every encoding when the file asks for them (``add_bos_token``)."""
    from tokenizers.processors import TemplateProcessing

    before = [(tokens[bos_id], bos_id)] if config["add_bos_token"] and bos_id is not None else []
    after = [(tokens[eos_id], eos_id)] if config["add_eos_token"] and eos_id is not None else []
    if not before and not after:
        return None
    specials = before + after
    names = [name for name, _ in specials]
    return TemplateProcessing(
        single=" ".join([*names[: len(before)], "$A", *names[len(before) :]]),
        pair=" ".join([*names[: len(before)], "$A", "$B", *names[len(before) :]]),
        special_tokens=specials,
    )


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_bytes_to_unicode().values())
