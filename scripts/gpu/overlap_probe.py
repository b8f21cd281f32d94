"""Issue 12: can the fp8 decode attention run beside the fp8 GEMMs on one GPU? (session 38;
written, not yet run on a GPU)

At every kernel's floor, with nothing overlapped, the 600 x 1,000 / 1,000 workload (fp8
weights + fp8 KV) would give about 21.9k out tok/s (session 34); measured 14.1k (session 38),
with the decode attention at 71% of its KV floor and the GEMMs at 73% of theirs. 19k needs
the two to overlap: the attention is bound by memory, the GEMMs at 600 rows by the tensor
cores, so two micro-batches (the attention of one beside the GEMMs of the other) could hide
much of the shorter. Whether the hardware overlaps them depends on both kernels finding SMs:
the cuBLAS fp8 GEMMs are persistent (one block an SM, most of its shared memory), and the
decode's programs fill every SM they can. PyTorch's experimental SM carveout
(``torch._C._set_sm_carveout_experimental(n)``: cuBLASLt's SM_COUNT_TARGET, SM count minus
n) makes the GEMMs leave n SMs to the attention.

For half the workload's decode batch (300 requests x 1,500 tokens; ``--rows``,
``--context``), over 32 layers (``--layers``), CUDA-graph replay medians:

- ``attention``: the fp8-MMA decode attention (the engine's backend and defaults), one
  layer's cache after another (``kvq_decode_bench.build``, checked against the torch path);
- ``gemms``: each layer's four fp8 GEMMs at Llama-3-8B shapes (q/k/v, o, gate/up, down; the
  engine's ``Fp8Kernel``: per-token activation quantization, then ``torch._scaled_mm``),
  each layer its own weights (7 GB: no L2 reuse);
- ``sequential``: both on one stream;
- ``concurrent``: the attention on one stream beside the GEMMs on another, one graph;

for each carveout in ``--carveouts`` (0: none). The overlap is (attention + gemms -
concurrent) / min(attention, gemms): 0 nothing hidden, 1 the shorter hidden entirely. The
two streams here share nothing (a real micro-batch schedule chains each layer's kernels),
so this is what the hardware allows, not yet what a schedule would get.

    python scripts/gpu/overlap_probe.py [--rows 300] [--context 1500] [--carveouts 0,16,32,48,66]

``--chains`` (session 39) times the schedule itself, each layer's kernels in order (q/k/v
GEMM, attention, o GEMM, gate/up GEMM, SiLU-and-mul, down GEMM; the fp8 GEMMs with
their activation quantization) for 32 layers:

- ``step``: today's decode step, one stream, the GEMMs at both halves' rows (``2 x
  --rows``) and each layer's attention as the two halves' launches;
- ``halves_sequential``: half A's whole chain, then half B's, one stream (the weights read
  twice: what two micro-batches cost without overlap);
- ``halves_concurrent``: A's chain on one stream beside B's on another, one graph;
- ``halves_staggered``: the same, B starting when A's first attention ends (so that B's
  GEMMs meet A's attention);

for each carveout. The step's gain is ``step / halves_concurrent``.

``--green`` lives in ``green_probe.py`` (session 41: the attention and the GEMMs each on
their own SMs, through green contexts).

Prints a table and writes JSON to $OUT/overlap_probe.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvq_decode_bench import build  # noqa: E402

from tokenloom.plugins.models.cuda_timing import median_cuda_us  # noqa: E402
from tokenloom.plugins.quant.fp8 import Fp8Kernel  # noqa: E402

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3-8B: 32 + 2 x 8 heads of 128
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def fp8_kernels(layers: int, gen: torch.Generator) -> list[Fp8Kernel]:
    """Each layer's four fp8 projections at Llama-3-8B shapes (``SHAPES``), random weights
    from ``gen``, quantized per output channel: 7 GB over 32 layers, no L2 reuse."""
    kernels = []
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
            scales = w.abs().amax(1, keepdim=True).float() / 448.0
            kernels.append(Fp8Kernel((w / scales).to(torch.float8_e4m3fn), scales))
            del w
    return kernels


def gemms(rows: int, layers: int) -> Callable[[], None]:
    """Each layer's four fp8 GEMMs at ``rows`` rows, random weights, fixed inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernels = fp8_kernels(layers, gen)
    inputs = {k: torch.randn(rows, k, generator=gen, device="cuda").bfloat16() for _, k in SHAPES}

    def run() -> None:
        for kernel in kernels:
            kernel.apply(inputs[kernel.weight.shape[1]], None)

    return run


def chain_gemms(rows: int, kernels: list[Fp8Kernel]) -> list[Callable[[], None]]:
    """Each layer's MLP and attention projections at ``rows`` rows, over ``kernels`` (four
    a layer, ``SHAPES``' order), as four callables a layer: q/k/v, o, gate/up with
    SiLU-and-mul, down."""
    from tokenloom.plugins.models.fused_ops import silu_and_mul

    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = {k: torch.randn(rows, k, generator=gen, device="cuda").bfloat16() for _, k in SHAPES}
    calls: list[Callable[[], None]] = []

    def call(kernel: Fp8Kernel, x: torch.Tensor, silu: bool) -> Callable[[], None]:
        def run() -> None:
            y = kernel.apply(x, None)
            if silu:
                silu_and_mul(y)

        return run

    for i, kernel in enumerate(kernels):  # gate/up (i % 4 == 2), then SiLU-and-mul
        calls.append(call(kernel, inputs[kernel.weight.shape[1]], i % 4 == 2))
    return calls


def chain(gemm_calls: list[Callable[[], None]], attention: list[list[Callable[[], None]]],
          after_first: Callable[[], None] | None = None) -> Callable[[], None]:  # fmt: skip
    """Layer by layer: q/k/v, each of ``attention``'s launches of the layer, o, gate/up,
    down; ``after_first`` after the first layer's attention."""

    def run() -> None:
        for layer in range(len(gemm_calls) // 4):
            qkv, o, gate_up, down = gemm_calls[4 * layer : 4 * layer + 4]
            qkv()
            for half in attention:
                half[layer]()
            if layer == 0 and after_first is not None:
                after_first()
            o()
            gate_up()
            down()

    return run


def chains(args: argparse.Namespace) -> list[dict[str, float]]:
    """``--chains``: the decode step as one chain against two half-batch chains."""
    attn_a, layers, error = build(args.rows, args.context, args.layers, "fp8", "cuda", {})
    attn_b, _, _ = build(args.rows, args.context, layers, "fp8", "cuda", {})
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernels = fp8_kernels(layers, gen)
    full = chain_gemms(2 * args.rows, kernels)
    half_a, half_b = chain_gemms(args.rows, kernels), chain_gemms(args.rows, kernels)
    a_layers, b_layers = attn_a.layers, attn_b.layers  # type: ignore[attr-defined]
    step = chain(full, [a_layers, b_layers])
    chain_a, chain_b = chain(half_a, [a_layers]), chain(half_b, [b_layers])
    side = torch.cuda.Stream()

    def staggered() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        first_done = torch.cuda.Event()

        def mark() -> None:
            first_done.record(main)

        def run_b() -> None:
            side.wait_event(first_done)
            with torch.cuda.stream(side):
                chain_b()

        def then() -> None:
            mark()
            run_b()

        chain(half_a, [a_layers], after_first=then)()
        main.wait_stream(side)

    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        torch._C._set_sm_carveout_experimental(carveout or None)
        t_step = timed(step)

        def sequential() -> None:
            chain_a()
            chain_b()

        t_seq = timed(sequential)
        t_par = timed(concurrent(chain_a, chain_b))
        t_stag = timed(staggered)
        rows.append({"carveout": carveout, "step_ms": t_step, "halves_sequential_ms": t_seq,
                     "halves_concurrent_ms": t_par, "halves_staggered_ms": t_stag,
                     "gain": t_step / min(t_par, t_stag)})  # fmt: skip
        print(
            f"chains carveout {carveout:3d}: step {t_step:7.3f} ms  halves sequential "
            f"{t_seq:7.3f}  concurrent {t_par:7.3f}  staggered {t_stag:7.3f}  "
            f"gain x{rows[-1]['gain']:.3f}",
            flush=True,
        )
    torch._C._set_sm_carveout_experimental(None)
    print(f"attention relative error vs torch: {error:.3g}")
    return rows


def timed(body: Callable[[], None]) -> float:
    """Median ms of a CUDA-graph replay of ``body`` (captured after one eager warm-up)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=100))


def concurrent(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """``first`` on the current stream beside ``second`` on a side stream (fork and join,
    as a CUDA graph captures them)."""
    return beside(torch.cuda.Stream(), second, first)


def eager_ms(body: Callable[[], None], reps: int) -> float:
    """Median ms of ``body`` run eagerly (``cuda_timing``'s events and warm-up)."""
    return median_cuda_us(body, reps) / 1e3


def beside(
    stream: torch.cuda.Stream, there: Callable[[], None], here: Callable[[], None]
) -> Callable[[], None]:
    """``there`` on ``stream`` while ``here`` runs on the current stream (fork, join)."""

    def run() -> None:
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            there()
        here()
        main.wait_stream(stream)

    return run


def probe_parser(doc: str | None) -> argparse.ArgumentParser:
    """The probes' shared arguments: the decode step's shape, repetitions, JSON out."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    return parser


def main() -> int:
    parser = probe_parser(__doc__)
    parser.add_argument("--carveouts", default="0,16,32,48,66")
    parser.add_argument("--chains", action="store_true", help="the schedule (see above)")
    args = parser.parse_args()
    if args.chains:
        result = chains(args)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows_per_half": args.rows,
                           "context": args.context, "chains": result}, f, indent=2)  # fmt: skip
        return 0
    attention, layers, error = build(args.rows, args.context, args.layers, "fp8", "cuda", {})
    mlp = gemms(args.rows, layers)
    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        torch._C._set_sm_carveout_experimental(carveout or None)
        a, g = timed(attention), timed(mlp)
        seq = timed(lambda: (attention(), mlp()))
        par = timed(concurrent(attention, mlp))
        overlap = (a + g - par) / min(a, g)
        rows.append({"carveout": carveout, "attention_ms": a, "gemms_ms": g,
                     "sequential_ms": seq, "concurrent_ms": par, "overlap": overlap})  # fmt: skip
        print(
            f"carveout {carveout:3d}: attention {a:7.3f} ms  gemms {g:7.3f} ms  sequential "
            f"{seq:7.3f} ms  concurrent {par:7.3f} ms  overlap {overlap:5.2f}",
            flush=True,
        )
    torch._C._set_sm_carveout_experimental(None)
    path = args.json or (
        os.path.join(os.environ["OUT"], "overlap_probe.json") if "OUT" in os.environ else None
    )
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows_per_half": args.rows,
                       "context": args.context, "layers": layers,
                       "attention_rel_error_vs_torch": error, "rows": rows}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
