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
if os.environ.get("TRITON_INTERPRET") == "1":  # e4m3 as the GPU converts it
    from interpreter_e4m3 import install

    install()


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


@pytest.fixture
def int4_llama_tokens(tiny_model_factory):
    """``tokens(eager, projection, quant="int4") -> token ids``: a tiny quantized Llama (bf16,
    one GPU) decoding two prompts greedily. With ``eager``, every layer's ``projection``
    ("qkv_proj", "o_proj", "gate_up_proj") has its one-row tiling forced to the one-row
    GEMV over row-major weights (int4: ``int4_gemv_nk`` 16 x 1024 / 4, dp4a; int8:
    ``int8_gemv_nk`` 16 x 1024 / 4, biased), so that kernel's options run whatever the
    tuner chose; without, the model runs as tuned, in CUDA graphs."""
    model = str(tiny_model_factory("llama", hidden_size=1024, intermediate_size=2048,
                                   num_heads=8, num_kv_heads=2))  # fmt: skip

    def tokens(eager: bool, projection: str, quant: str = "int4") -> list[list[int]]:
        from tokenloom import LLM, SamplingParams
        from tokenloom.plugins.quant.kernels.dispatch import bucket
        from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig

        llm = LLM(model, dtype="bfloat16", device="cuda", quant=quant, max_num_seqs=1,
                  enforce_eager=eager)  # fmt: skip
        if eager:
            nk = GemmConfig(1, 16, 1024, 1, 4, 3, nk=True, dp4a=quant == "int4",
                            biased=quant == "int8")  # fmt: skip
            for layer in llm.engine.executor.model.model.layers:
                owner = layer.mlp if projection == "gate_up_proj" else layer.self_attn
                kernel = getattr(owner, projection).kernel
                kernel.configs = tuple(
                    nk if i == bucket(1) else c for i, c in enumerate(kernel.configs)
                )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.engine.shutdown()

    return tokens


@pytest.fixture
def spy_early(monkeypatch):
    """``spy(*modules) -> names``: from then on, the names of the modules whose launches
    asked ``pdl.early_release`` and got True (the o projection's GEMVs), in order."""

    def spy(*modules):  # type: ignore[no-untyped-def]
        early: list[str] = []
        for module in modules:

            def asked(real=module.early_release, name=module.__name__) -> bool:  # type: ignore[no-untyped-def]
                on = real()
                if on:
                    early.append(name)
                return on

            monkeypatch.setattr(module, "early_release", asked)
        return early

    return spy
