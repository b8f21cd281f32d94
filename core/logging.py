"""Logging setup: one ``tokenloom`` logger tree, level from ``TOKENLOOM_LOG_LEVEL``.

Modules call ``get_logger(__name__)``; the first call attaches a stderr handler to
the ``tokenloom`` logger unless the application configured one already.
"""

from __future__ import annotations

import logging
import os

ROOT = "tokenloom"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module under ``tokenloom``), configured on first use."""
    global _configured
    if not _configured:
        _configured = True
        root = logging.getLogger(ROOT)
        level = os.environ.get("TOKENLOOM_LOG_LEVEL", "INFO").upper()
        root.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
        if not root.handlers:
            handler = logging.StreamHandler()
            fmt = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"
            handler.setFormatter(logging.Formatter(fmt))
            root.addHandler(handler)
    return logging.getLogger(name)
