"""Measured kernel choices kept across runs: one JSON file per kind in the tokenloom
cache directory (``$TOKENLOOM_CACHE``, default ``~/.cache/tokenloom``).

Used by the skinny bf16 GEMM (``skinny-gemm.json``) and the quantized weight GEMM
(``weight-gemm.json``): a choice measured once per GPU, library version and shape.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("tokenloom.tuning")


def cache_file(name: str) -> Path:
    base = os.environ.get("TOKENLOOM_CACHE") or Path.home() / ".cache" / "tokenloom"
    return Path(base) / name


def load(name: str) -> dict[str, Any]:
    """The stored choices, or {} when the file is missing or unreadable."""
    try:
        return dict(json.loads(cache_file(name).read_text()))
    except (OSError, ValueError):
        return {}


def store(name: str, key: str, value: Any) -> None:
    """Add ``key`` to the file (write-then-rename: readers never see half a file); a
    failure to write is logged, not raised (the choice still holds for this process)."""
    stored = load(name)
    stored[key] = value
    try:
        target = cache_file(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(stored, indent=1))
        os.replace(partial, target)
    except OSError as err:
        log.warning("could not store %s: %s", name, err)
