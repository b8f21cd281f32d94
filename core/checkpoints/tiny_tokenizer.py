"""The tokenizer half of the tiny checkpoints: a byte-level BPE trained in-process on
a built-in corpus, each architecture's special tokens and roles, and its chat template.

``write_tokenizer_files(path, arch)`` writes tokenizer.json and tokenizer_config.json;
``tiny_models.write_tiny_model`` writes them next to the weights. tokenizers is
imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
_TOKENIZER_VOCAB = 640

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say many things.
Once upon a time there was a little engine that wanted to serve every request quickly.
It read the prompt, computed the keys and the values, and wrote them into its cache.
Then it sampled one token after another until the answer was complete or it ran out of time.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Loom.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 and dates like 2024-05-17.
The weather is nice in the spring, and the trees are green in the summer.
In the autumn the leaves fall, and in the winter the snow covers the ground.
Questions and answers, user and assistant, system and tool: a conversation has many roles.
Python code looks like this: def add(a, b): return a + b  # a short function
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, \u65e5\u672c\u8a9e, \u4f60\u597d, \U0001f600 and \U0001f680 are text too.
"""

SPECIAL_TOKENS = {
    "llama": ["<unk>", "<s>", "</s>"],
    "mistral": ["<unk>", "<s>", "</s>"],
    "llama3": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}

# (bos, eos in tokenizer_config, eos ids in config.json, pad, unk)
TOKEN_ROLES: dict[str, tuple[str | None, str, list[str], str | None, str | None]] = {
    "llama": ("<s>", "</s>", ["</s>"], None, "<unk>"),
    "mistral": ("<s>", "</s>", ["</s>"], None, "<unk>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"], None, None),
    "qwen2": (None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", None),
    "qwen3": (None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", None),
}

_INST_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- '[INST] <<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    '{%- if date_string is not defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'system' %}{{- 'Today Date: ' + date_string + '\\n\\n' }}{%- endif %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CHAT_TEMPLATES = {
    "llama": _INST_TEMPLATE,
    "mistral": _INST_TEMPLATE,
    "llama3": _LLAMA3_TEMPLATE,
    "qwen2": _CHATML_TEMPLATE,
    "qwen3": _CHATML_TEMPLATE,
}


def write_tokenizer_files(path: str | os.PathLike[str], arch: str, max_length: int = 1024) -> None:
    """Write only tokenizer.json and tokenizer_config.json of ``arch`` into ``path``
    (used with real model configs whose weights are random, e.g. benchmarks)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(trained_tokenizer_json(arch), encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(arch, max_length))


_TOKENIZER_CACHE: dict[str, str] = {}


def trained_tokenizer_json(arch: str) -> str:
    """A byte-level BPE trained on the corpus, with the arch's special tokens first."""
    if arch in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[arch]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = SPECIAL_TOKENS[arch]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos = TOKEN_ROLES[arch][0]
    if bos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = special.index(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    _TOKENIZER_CACHE[arch] = tokenizer.to_str()
    return _TOKENIZER_CACHE[arch]


def tokenizer_config(arch: str, max_length: int) -> dict[str, Any]:
    bos, eos, _, pad, unk = TOKEN_ROLES[arch]
    special = SPECIAL_TOKENS[arch]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": _CHAT_TEMPLATES[arch],
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(special)
        },
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
