"""Fixtures shared by the quantization tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Path:
    """A tiny random Llama checkpoint (the calibrated methods' subject)."""
    return Path(tiny_model_factory("llama"))
