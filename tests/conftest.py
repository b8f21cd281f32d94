"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip cleanly without CUDA."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("TOKENLOOM_LOG_LEVEL", "WARNING")
# Without a GPU, Triton kernels run under its interpreter; it must be set before
# triton is imported anywhere.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """``make(arch, **options) -> Path``: a small random checkpoint, cached per options."""
    from tokenloom.checkpoints.tiny_models import write_tiny_model

    cache: dict[tuple, object] = {}

    def make(arch: str = "llama", **options):
        key = (arch, tuple(sorted(options.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"model-{arch}")
            cache[key] = write_tiny_model(path, arch, **options)
        return cache[key]

    return make
