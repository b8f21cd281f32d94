"""GGUF checkpoints (llama.cpp's single-file format) as tokenloom models.

A GGUF file, or a directory holding exactly one (and no config.json), works wherever
a Hugging Face directory does: ``loader.load_model`` and ``Tokenizer.from_dir``
dispatch here through ``find_gguf``. The file is converted once into a Hugging Face
style directory in the cache (``checkpoint.converted_checkpoint``): config.json from
the metadata (``metadata``), tokenizer.json and tokenizer_config.json from the
vocabulary (``tokenizer``), and the weights dequantized into the target dtype with
llama.cpp's rope permutation undone (``tensors``). Later starts read that directory.

Importing this package is light (no numpy, no torch, no gguf): the frontend and the
CLI call ``find_gguf``.
"""

from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"
# The key under which ``loader.load_model`` hands a GGUF model's source file to the
# ``prepare`` hook (in ``hf_config``, real weights only): a quant method may read the
# file's own quantized blocks instead of the dequantized copy (``quant.gguf_int4``).
SOURCE_KEY = "tokenloom_gguf_file"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the path itself when it is a ``.gguf`` file, or
    the single ``.gguf`` file of a directory without config.json; None for anything
    else (a Hugging Face directory, a missing path). Raises ValueError for a
    directory holding several ``.gguf`` files (which one is meant is unclear)."""
    root = Path(path)
    if root.is_file():
        return root if root.suffix.lower() == GGUF_SUFFIX else None
    if not root.is_dir() or (root / "config.json").is_file():
        return None
    files = sorted(p for p in root.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{root}: several .gguf files ({names}); pass the path of one")
    return files[0] if files else None
