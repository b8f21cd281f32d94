"""Which kernel each of a model's 16-bit linear layers runs at few rows, measured on
the GPU at start-up (``SkinnyDispatch.tune``): cuBLAS or the skinny Triton GEMM for
inputs of up to 16 rows, the one-row GEMV (``skinny_gemm``), and the one-row GEMV with
the norm (and SiLU) folded in (``fused_gemv``). The faster is kept per shape, so nothing
gets slower on a GPU where cuBLAS wins. Decisions are remembered per GPU model, shape,
dtype and software versions in ``$TOKENLOOM_CACHE/skinny-gemm.json`` (and for the
process), so the same setup always runs the same kernels and gives the same tokens.

It sits above the kernels and the layers it tunes: neither imports it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import triton

from tokenloom.plugins.models import tuning_cache
from tokenloom.plugins.models.cuda_timing import fastest_config, time_graph
from tokenloom.plugins.models.fused_gemv import FUSED_VERSION, measure_fused
from tokenloom.plugins.models.layers import Embedding, Linear, fused_offered
from tokenloom.plugins.models.pdl import pdl_on
from tokenloom.plugins.models.skinny_gemm import (
    CONFIGS,
    GEMV_CONFIGS,
    GEMV_VERSION,
    gemv,
    gemv_offered,
    skinny_gemm,
)

log = logging.getLogger("tokenloom.models")

Choice = tuple[int, int, int, int] | None
GemvChoice = tuple[int, int, int] | None
_DECIDED: dict[str, Any] = {}  # for the process, on top of the file


CACHE_NAME = "skinny-gemm.json"


def _decided(key: str, measure: Callable[[], Any]) -> Any:
    """The choice stored under ``key`` (this process's, else the cache file's), else
    ``measure()``'s, stored; configs come back as tuples, cuBLAS as None."""
    if key not in _DECIDED:
        stored = tuning_cache.load(CACHE_NAME)
        if key in stored:
            _DECIDED[key] = tuple(stored[key]) if stored[key] else None
        else:
            _DECIDED[key] = measure()
            tuning_cache.store(CACHE_NAME, key, _DECIDED[key])
    return _DECIDED[key]


def _tunable(w: torch.Tensor) -> bool:
    """A 16-bit weight on a GPU, rows contiguous (fp32 stays on cuBLAS: exact agreement
    with reference runs)."""
    return (
        w.device.type == "cuda"
        and w.dim() == 2
        and w.stride(1) == 1
        and w.dtype in (torch.bfloat16, torch.float16)
    )


class SkinnyDispatch:
    """Per weight shape, the faster of cuBLAS and the skinny kernel at 1 and 8 rows
    (measured once per setup); ``choose`` returns the config to use, or None for
    cuBLAS. The skinny kernel must win by 5% to be taken."""

    def __init__(self) -> None:
        self.choices: dict[str, Choice] = {}
        self.gemv_choices: dict[str, GemvChoice] = {}

    def choose(self, w: torch.Tensor) -> Choice:
        if not _tunable(w):
            return None
        key = (
            f"{torch.cuda.get_device_name(w.device)}|torch {torch.__version__}|"
            f"triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|{w.dtype}"
        )
        self.choices[key] = _decided(key, lambda: self._measure(w))
        return self.choices[key]

    def choose_gemv(self, w: torch.Tensor, skinny: Choice) -> GemvChoice:
        """The one-row GEMV's config for ``w`` where it beats, at one row, what the
        layer runs otherwise (cuBLAS, or ``skinny``) by 3%; else None."""
        if not _tunable(w) or not gemv_offered():
            return None
        key = (
            f"gemv v{GEMV_VERSION}|{torch.cuda.get_device_name(w.device)}|torch {torch.__version__}|"
            f"triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|{w.dtype}|{skinny}"
            f"|pdl {pdl_on(w.device)}"
        )
        self.gemv_choices[key] = _decided(key, lambda: self._measure_gemv(w, skinny))
        return self.gemv_choices[key]

    def tune(self, model: torch.nn.Module) -> str:
        """Per linear shape of ``model``: the skinny Triton GEMM for inputs of <= 16 rows
        where it measured faster than cuBLAS (small-batch decode), the one-row GEMV for
        single rows where it measured faster than either (the LM head too), and the GEMV
        with the norm (and SiLU) folded in where the model allows it (``Linear.fusable``)
        and it measured faster than the kernels apart. Returns a line for the log."""
        fused = 0
        for module in model.modules():
            if isinstance(module, Linear) and module.kernel is None:
                module.skinny = self.choose(module.weight)
                module.gemv = self.choose_gemv(module.weight, module.skinny)
                if module.fusable is not None:
                    silu = module.fusable == "norm+silu"
                    module.fused = self.choose_fused(module.weight, module.gemv, silu, module.bias)
                    fused += module.fused is not None
        lm_head = getattr(model, "lm_head", None)
        if (
            isinstance(lm_head, Embedding)
            and lm_head.logits_kernel is None
            and os.environ.get("TOKENLOOM_LM_HEAD_GEMV", "1") != "0"  # for A/B runs
        ):
            lm_head.gemv = self.choose_gemv(lm_head.weight, None)  # else F.linear
        chosen = sum(c is not None for c in self.choices.values())
        gemvs = sum(c is not None for c in self.gemv_choices.values())
        return (
            f"skinny GEMM chosen for {chosen} of {len(self.choices)} linear shapes, the one-row "
            f"GEMV for {gemvs}, the GEMV with the norm folded in for {fused} layers"
        )

    def choose_fused(
        self,
        w: torch.Tensor,
        gemv_config: GemvChoice,
        silu: bool,
        bias: torch.Tensor | None = None,
    ) -> GemvChoice:
        """The config of the GEMV with the norm (and SiLU) folded in
        (``fused_gemv.norm_gemv``) where it beats, at one row, the add+norm kernel and
        the plain GEMV ``gemv_config`` (then SiLU) by 3%; else None."""
        if gemv_config is None or not _tunable(w):
            return None
        if not fused_offered():
            return None
        key = (
            f"fused v{FUSED_VERSION}|{torch.cuda.get_device_name(w.device)}|torch "
            f"{torch.__version__}|triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|"
            f"{w.dtype}|{gemv_config}|silu {silu}|bias {bias is not None}|pdl {pdl_on(w.device)}"
        )
        return _decided(key, lambda: self._measure_fused(w, gemv_config, silu, bias))

    @torch.inference_mode()
    def _measure_fused(
        self, w: torch.Tensor, gemv_config: GemvChoice, silu: bool, bias: torch.Tensor | None
    ) -> GemvChoice:
        assert gemv_config is not None
        best, unfused, fused = measure_fused(w, gemv_config, silu, time_graph, bias)
        log.info(
            "linear %s at one row, norm%s folded in: unfused %.1f us, %s",
            tuple(w.shape),
            " and SiLU" if silu else "",
            unfused,
            f"fused {best} {fused:.1f} us" if best else "kept unfused",
        )
        return best

    @torch.inference_mode()
    def _measure_gemv(self, w: torch.Tensor, skinny: Choice) -> GemvChoice:
        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
        # in the weight's dtype: no float32 copy of a large weight (an LM head: 2 GB)
        expected = torch.nn.functional.linear(x, w).float()
        if skinny is None:
            current = time_graph(lambda: torch.nn.functional.linear(x, w))
        else:
            current = time_graph(lambda: skinny_gemm(x, w, skinny))
        best, best_time = fastest_config(
            GEMV_CONFIGS, lambda c: gemv(x, w, c), expected, current, time_graph
        )
        log.info(
            "linear %s at one row: %s %.1f us, %s",
            tuple(w.shape),
            "skinny" if skinny else "cuBLAS",
            current,
            f"GEMV {best} {best_time:.1f} us" if best else "kept",
        )
        return best

    @torch.inference_mode()
    def _measure(self, w: torch.Tensor) -> Choice:
        best: Choice = None
        rows = (1, 8)
        xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for m in rows]
        cublas = sum(time_graph(lambda x=x: torch.nn.functional.linear(x, w)) for x in xs)
        best_time = cublas
        for config in CONFIGS:
            try:
                t = sum(time_graph(lambda x=x, c=config: skinny_gemm(x, w, c)) for x in xs)
            except Exception as err:  # e.g. a tile needing more shared memory than the GPU has
                log.debug("skinny GEMM config %s failed on %s: %s", config, tuple(w.shape), err)
                continue
            if t < (0.95 if best is None else 1.0) * best_time:
                best, best_time = config, t
        log.info(
            "linear %s: cuBLAS %.1f us, %s %.1f us (rows 1 + 8)",
            tuple(w.shape),
            cublas,
            "skinny " + str(best) if best else "kept cuBLAS",
            best_time,
        )
        return best
