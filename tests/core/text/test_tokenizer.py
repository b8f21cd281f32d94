"""The tokenizer: lossless text round trips, the same ids and chat prompts as
transformers, and the end-of-sequence ids gathered from every config file."""

from __future__ import annotations

import json

import pytest

from tokenloom.checkpoints.tiny_models import ARCHS
from tokenloom.text.tokenizer import ChatTemplateError, Tokenizer, model_eos_token_ids

TEXTS = ["Hello, world!", "Café naïve résumé 日本 你好 😀🚀", "  spaces\tand\nnewlines  ", ""]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, 日本?"},
    {"role": "assistant", "content": "Hello. 😀"},
    {"role": "user", "content": "Count to three."},
]


@pytest.fixture(params=ARCHS)
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_round_trips(model_dir, text):
    tok = Tokenizer.from_dir(model_dir)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(text)) == text  # the BOS is special, so it is skipped


def test_ids_and_special_tokens_match_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    ids = theirs.encode(TEXTS[1])
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    # Ours lists every token marked special; theirs only the named roles (bos, eos...).
    assert set(theirs.all_special_ids) <= set(ours.all_special_ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(model_dir, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert "Count to three." in rendered


def test_template_keyword_arguments_and_tools_reach_the_template(tiny_model_factory):
    transformers = pytest.importorskip("transformers")
    model_dir = tiny_model_factory("qwen3")
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    kwargs = {"enable_thinking": False, "tools": tools}

    rendered = ours.apply_chat_template(CONVERSATION[1:2], **kwargs)

    assert rendered == theirs.apply_chat_template(
        CONVERSATION[1:2], tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert '"name": "météo"' in rendered  # tojson keeps non-ASCII text


def test_raise_exception_in_template_becomes_chat_template_error(tiny_model_factory):
    tok = Tokenizer.from_dir(tiny_model_factory("llama"))
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.apply_chat_template(two_users)


def test_named_templates_select_default_or_tool_use(tmp_path, tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "x"}]

    assert tok.apply_chat_template(messages) == "Dx"
    assert tok.apply_chat_template(messages, tools=[{}, {}]) == "T2"
    assert tok.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "T0"
    assert tok.apply_chat_template(messages, chat_template="inline {{ 1 + 1 }}") == "inline 2"


def test_chat_template_file_is_used_when_config_has_none(tmp_path, tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])

    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{% endfor %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>"


def test_eos_ids_merge_config_generation_config_and_tokenizer(tiny_model_factory):
    llama3 = Tokenizer.from_dir(tiny_model_factory("llama3"))
    assert llama3.eos_token_ids == [1, 4]  # <|end_of_text|>, <|eot_id|>
    qwen = Tokenizer.from_dir(tiny_model_factory("qwen2"))
    assert qwen.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|> from generation
    llama = Tokenizer.from_dir(tiny_model_factory("llama"))
    assert llama.eos_token_ids == [2] and llama.bos_token_id == 1


def test_model_eos_ids_accept_int_or_list_and_missing_files(tmp_path):
    assert model_eos_token_ids(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 8]}))
    assert model_eos_token_ids(tmp_path) == [7, 9, 8]


def test_skip_special_tokens_drops_only_special_ids(tiny_model_factory):
    tok = Tokenizer.from_dir(tiny_model_factory("qwen3"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert tok.decode(ids) == "user\nhi\nassistant\n"
    assert set(tok.all_special_ids) == {0, 1, 2}


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_importing_the_tokenizer_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tokenloom.text.tokenizer; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
