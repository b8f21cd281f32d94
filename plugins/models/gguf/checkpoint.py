"""A GGUF file converted once into a Hugging Face style directory in the cache.

``$TOKENLOOM_CACHE/gguf/<sha256 of the file>-v<FORMAT>/`` holds config.json,
tokenizer.json and tokenizer_config.json (``converted_dir``) and, per target dtype,
``model.<dtype>.safetensors`` with the dequantized weights (``converted_weights``).
Keyed by the file's content, not its path: a replaced file is converted anew, a
copied one is not. Every file is written to a temporary name and renamed, so a
process that starts while another converts sees either nothing or a whole file.
Hashing reads the whole file each start (about 0.1 s for 93 MB); conversion happens
the first time only. torch is imported only for the weights, so the tokenizer
(frontend) side stays light.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1  # bump when the conversion's output changes
METADATA_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")  # config.json last


def cache_root() -> Path:
    """``$TOKENLOOM_CACHE/gguf`` (default ``~/.cache/tokenloom/gguf``)."""
    base = os.environ.get("TOKENLOOM_CACHE") or Path.home() / ".cache" / "tokenloom"
    return Path(base) / "gguf"


def file_digest(path: Path) -> str:
    """SHA-256 of the file's content, hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def converted_dir(gguf_path: Path) -> Path:
    """The cache directory of ``gguf_path`` with its config and tokenizer files,
    written now if missing. Raises UnsupportedGGUFError (a ValueError) naming an
    unsupported architecture, tensor type or tokenizer."""
    out, _ = _convert(gguf_path, None)
    return out


def converted_weights(gguf_path: Path, dtype: Any) -> tuple[Path, Path]:
    """(cache directory, safetensors file of the weights in ``dtype``, a
    ``torch.dtype``), converting what is missing."""
    out, weights = _convert(gguf_path, dtype)
    assert weights is not None
    return out, weights


def _convert(gguf_path: Path, dtype: Any) -> tuple[Path, Path | None]:
    """Write what the cache entry lacks, opening the file (slow: seconds for a large
    vocabulary) at most once."""
    out = cache_root() / f"{file_digest(gguf_path)}-v{FORMAT_VERSION}"
    reader = None
    if not all((out / name).is_file() for name in METADATA_FILES):
        reader = _open(gguf_path)
        _write_metadata_files(reader, out)
    if dtype is None:
        return out, None
    weights = out / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
    if not weights.is_file():
        from safetensors.torch import save_file

        from tokenloom.plugins.models.gguf.tensors import hf_tensors

        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        tensors = dict(hf_tensors(reader or _open(gguf_path), config, dtype))
        _write_atomically(weights, lambda tmp: save_file(tensors, str(tmp)))
    return out, weights


def _open(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    from tokenloom.plugins.models.gguf.metadata import UnsupportedGGUFError

    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:  # bad magic, truncated file
        raise UnsupportedGGUFError(f"{gguf_path}: cannot read GGUF file: {exc}") from exc


def _write_metadata_files(reader: Any, out: Path) -> None:
    from tokenloom.plugins.models.gguf.metadata import hf_config, read_metadata
    from tokenloom.plugins.models.gguf.tensors import check_tensor_types
    from tokenloom.plugins.models.gguf.tokenizer import tokenizer_files

    metadata = read_metadata(reader)
    config = hf_config(metadata, {tensor.name: tensor for tensor in reader.tensors})
    check_tensor_types(reader)
    tokenizer_json, tokenizer_config = tokenizer_files(metadata)
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(tokenizer_config, ensure_ascii=False, indent=2),
        "config.json": json.dumps(config, indent=2),
    }
    for name in METADATA_FILES:
        _write_atomically(out / name, _text_writer(texts[name]))


def _text_writer(text: str) -> Callable[[Path], Any]:
    return lambda tmp: tmp.write_text(text, encoding="utf-8")


def _write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
