"""Text <-> token ids and chat templates for a Hugging Face model directory.

Reads tokenizer.json with the ``tokenizers`` library and renders the chat template
of tokenizer_config.json (or chat_template.jinja / chat_template.json) with a
sandboxed jinja2 environment configured like Hugging Face transformers, so that the
same messages give the same prompt text. No torch import: the frontend loads this.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or raised while rendering."""


class Tokenizer:
    """A model's tokenizer: encoding, decoding, special ids and its chat template.

    Build with ``Tokenizer.from_dir(path)``. Instances are immutable after
    construction and safe to share across asyncio tasks.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        tokenizer_config: dict[str, Any],
        model_eos_ids: list[int],
        chat_template: str | dict[str, str] | None,
    ) -> None:
        self._backend = backend
        self._config = tokenizer_config
        self._special_tokens = {
            key: _token_content(tokenizer_config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self._model_eos_ids = model_eos_ids
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the model's eos ids from
        config.json and generation_config.json. Raises FileNotFoundError naming the
        missing tokenizer.json. ``path`` may also be a GGUF file or a directory holding
        one: its tokenizer is rebuilt from the file (``plugins.models.gguf``)."""
        from tokenloom.plugins.models.gguf import find_gguf

        root = Path(path)
        if (gguf_file := find_gguf(root)) is not None:
            from tokenloom.plugins.models.gguf.checkpoint import converted_dir

            root = converted_dir(gguf_file)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no tokenizer.json in the model directory")
        backend = _HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        return cls(backend, config, model_eos_token_ids(root), _find_chat_template(root, config))

    # ----------------------------------------------------------------------- ids

    @cached_property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (declared in tokenizer.json or tokenizer_config)."""
        ids = {
            token.content: int(i)
            for i, token in self._backend.get_added_tokens_decoder().items()
            if token.special
        }
        for i, entry in self._config.get("added_tokens_decoder", {}).items():
            if entry.get("special"):
                ids[entry["content"]] = int(i)
        for token in self._special_tokens.values():
            if token is not None and (token_id := self._backend.token_to_id(token)) is not None:
                ids[token] = token_id
        return sorted(set(ids.values()))

    @cached_property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._special_tokens["bos_token"])

    @cached_property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos token (the one chat templates close turns with)."""
        return self.token_to_id(self._special_tokens["eos_token"])

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: config.json's eos_token_id (int or list),
        generation_config.json's, then the tokenizer's eos token; no duplicates."""
        ids = list(self._model_eos_ids)
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        return ids

    @cached_property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self._special_tokens["pad_token"])

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ----------------------------------------------------------------------- text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the model's BOS (if any).
        Encode a rendered chat template with ``add_special_tokens=False``: templates
        already contain the BOS token."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """The vocabulary strings of ``ids`` (byte-level form, not decoded text);
        None for an id outside the vocabulary."""
        return [self._backend.id_to_token(i) for i in ids]

    # ----------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to prompt text with the model's chat template.

        ``chat_template`` is either a template's name (when the model ships several;
        default "default", or "tool_use" when tools are given and it exists) or the
        template source itself. Extra ``kwargs`` (e.g. ``enable_thinking``) are
        visible to the template. Raises ChatTemplateError when there is no template,
        it does not compile, or it calls ``raise_exception``.
        """
        source = self._select_template(chat_template, has_tools=bool(tools))
        context = {
            **{k: v for k, v in self._special_tokens.items() if v is not None},
            **kwargs,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        return render_chat_template(source, context)

    def _select_template(self, choice: str | None, has_tools: bool) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            name = choice or ("tool_use" if has_tools and "tool_use" in templates else "default")
            if name in templates:
                return templates[name]
            if choice is None:
                raise ChatTemplateError(
                    f"no 'default' chat template; pass chat_template= one of {sorted(templates)}"
                )
            return choice
        if choice is not None:
            return choice
        if templates is None:
            raise ChatTemplateError("the model has no chat template; pass chat_template=")
        return templates


def model_eos_token_ids(model_dir: str | Path) -> list[int]:
    """End-of-sequence ids from config.json then generation_config.json (each may hold
    an int or a list), in order, without duplicates. Missing files count as empty."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(Path(model_dir) / name).get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids


def _find_chat_template(root: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    template = config.get("chat_template")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _token_content(token: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------- rendering


def render_chat_template(source: str, context: dict[str, Any]) -> str:
    """Render a chat template the way Hugging Face transformers does: sandboxed,
    trim_blocks and lstrip_blocks, loop controls, ``raise_exception``,
    ``strftime_now`` and a ``tojson`` that keeps non-ASCII text as is."""
    try:
        template = _compile(source)
        return template.render(**context)
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2 TemplateError, or a template's own TypeError
        raise ChatTemplateError(f"chat template: {exc}") from exc


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _generation_tag() -> Any:
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks in transformers; for inference it renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
