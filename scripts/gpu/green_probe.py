"""The decode attention and the fp8 GEMMs, each on its own share of the SMs (green contexts).

Issue 12, session 41 (written in session 40, rebuilt over the driver API, since torch
2.11's ``GreenContext`` makes no stream: ``plugins/executor/green_contexts.py``): asks whether confining the
attention to a share of the SMs lets the two overlap, which two plain streams did not
(session 40 on an H100: 17-20% of the shorter hidden, the decode attention filling every
SM). The device is split into two green contexts, N SMs (rounded up by the driver) and the
rest; timed eagerly with CUDA events, medians of ``--reps``:

- every SM: ``attention`` and ``gemms`` (each layer's four fp8 GEMMs with SiLU-and-mul)
  alone, and on two plain streams;
- per N: the attention alone on its N SMs, the GEMMs alone on the rest, both at once, the
  overlap as above; then, last, the same as one captured CUDA graph (whether a graph
  keeps green streams);
- ``--pipeline``: the 2 x ``--rows`` decode step's chain on every SM (one stream) against
  two half batches pipelined over the partitions (every attention on the N SMs, every
  GEMM on the rest; the attention of one half beside the GEMMs of the other);
- then the GEMMs, both at once and the pipeline again with the cuBLAS carveout N (cuBLAS
  sizing its persistent grids for the GEMMs' partition, not the whole GPU).

    python scripts/gpu/green_probe.py --green 40,56,66,80 [--pipeline] [--rows 300]

Prints a table and writes JSON to --json PATH. The shapes and the chains are
``overlap_probe.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap_probe import (  # noqa: E402
    beside,
    build,
    chain,
    chain_gemms,
    eager_ms,
    fp8_kernels,
    probe_parser,
    timed,
)


def green(args: argparse.Namespace) -> list[dict[str, float | str]]:
    """``--green``: the attention on a green context of N SMs beside the GEMMs on the rest."""
    from tokenloom.plugins.executor.green_contexts import split

    attn_a, layers, error = build(args.rows, args.context, args.layers, "fp8", "cuda", {})
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernels = fp8_kernels(layers, gen)
    mlp = gemm_run(chain_gemms(args.rows, kernels))
    if args.pipeline:
        attn_b, _, _ = build(args.rows, args.context, layers, "fp8", "cuda", {})
        full = chain_gemms(2 * args.rows, kernels)
        halves = (chain_gemms(args.rows, kernels), chain_gemms(args.rows, kernels))
        attention_layers = (attn_a.layers, attn_b.layers)  # type: ignore[attr-defined]
        step = chain(full, list(attention_layers))
        t_step = eager_ms(step, args.reps)
        print(f"green: the 2 x {args.rows}-row step on every SM {t_step:7.3f} ms", flush=True)
    a0, g0 = eager_ms(attn_a, args.reps), eager_ms(mlp, args.reps)
    c0 = eager_ms(beside(torch.cuda.Stream(), attn_a, mlp), args.reps)
    print(f"green every SM: attention {a0:7.3f} ms  gemms {g0:7.3f} ms  two streams {c0:7.3f}")
    rows: list[dict[str, float | str]] = [
        {
            "attention_sms": 0,
            "attention_ms": a0,
            "gemms_ms": g0,
            "concurrent_ms": c0,
            "overlap": (a0 + g0 - c0) / min(a0, g0),
        }  # fmt: skip
    ]
    graphs: list[tuple[dict[str, float | str], Callable[[], None]]] = []
    for n in (int(c) for c in args.green.split(",")):
        part_ctx, rest_ctx = split(n)
        part, rest = part_ctx.stream(), rest_ctx.stream()
        a = eager_ms(beside(part, attn_a, lambda: None), args.reps)
        g = eager_ms(beside(rest, mlp, lambda: None), args.reps)
        gemms_there = beside(rest, mlp, lambda: None)
        both = beside(part, attn_a, gemms_there)
        par = eager_ms(both, args.reps)
        row: dict[str, float | str] = {
            "attention_sms": part_ctx.sms, "gemms_sms": rest_ctx.sms, "attention_ms": a,
            "gemms_ms": g, "concurrent_ms": par, "overlap": (a + g - par) / min(a, g),
            "vs_every_sm_two_streams": c0 / par,
        }  # fmt: skip
        print(
            f"green {part_ctx.sms:3d} + {rest_ctx.sms:3d} SMs: attention {a:7.3f} ms  gemms {g:7.3f} ms  "
            f"concurrent {par:7.3f} ms  overlap {row['overlap']:5.2f}",
            flush=True,
        )
        graphs.append((row, both))
        run = pipelined(halves, attention_layers, part, rest) if args.pipeline else None
        if run is not None:
            t_pipe = eager_ms(run, args.reps)
            row.update(step_ms=t_step, pipelined_ms=t_pipe, gain=t_step / t_pipe)
            print(f"green {part_ctx.sms:3d}: pipelined {t_pipe:7.3f} ms  x{t_step / t_pipe:.3f}")
        # cuBLAS sized for the GEMMs' partition (the carveout: its SM count target) rather
        # than the whole GPU, whose persistent grids would take two waves on the rest
        torch._C._set_sm_carveout_experimental(part_ctx.sms)
        g_c, par_c = eager_ms(gemms_there, args.reps), eager_ms(both, args.reps)
        row.update(gemms_carveout_ms=g_c, concurrent_carveout_ms=par_c)
        line = f"green {part_ctx.sms:3d}, carveout: gemms {g_c:7.3f} ms  concurrent {par_c:7.3f}"
        if run is not None:
            t_pipe_c = eager_ms(run, args.reps)
            row.update(pipelined_carveout_ms=t_pipe_c, gain=max(t_step / t_pipe_c, t_step / t_pipe))
            line += f"  pipelined {t_pipe_c:7.3f}  x{t_step / t_pipe_c:.3f}"
        torch._C._set_sm_carveout_experimental(None)
        print(line, flush=True)
        rows.append(row)
    for row, both in graphs:  # last: a failed capture may leave the context unusable
        try:
            row["concurrent_graph_ms"] = timed(both)
            print(
                f"green {row['attention_sms']}: as one CUDA graph {row['concurrent_graph_ms']:.3f} ms"
            )
        except Exception as e:  # noqa: BLE001 - whether a graph captures green streams
            row["graph_error"] = repr(e)[:300]
            print(f"green: a graph over green streams failed: {e!r}"[:300], flush=True)
            break
    print(f"attention relative error vs torch: {error:.3g}")
    return rows


def gemm_run(calls: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def pipelined(
    halves: tuple[list[Callable[[], None]], list[Callable[[], None]]],
    attention: tuple[list[Callable[[], None]], list[Callable[[], None]]],
    attn_stream: torch.cuda.Stream,
    gemm_stream: torch.cuda.Stream,
) -> Callable[[], None]:
    """Two half batches, every attention on ``attn_stream``, every GEMM on ``gemm_stream``:
    while the attention of one half runs, the GEMMs of the other (its o, gate/up, down and
    the next layer's q/k/v) do. Events carry each half's order between the streams."""

    def run() -> None:
        main = torch.cuda.current_stream()
        attn_stream.wait_stream(main)
        gemm_stream.wait_stream(main)
        layers = len(halves[0]) // 4
        qkv_done = [torch.cuda.Event(), torch.cuda.Event()]
        attn_done = [torch.cuda.Event(), torch.cuda.Event()]
        with torch.cuda.stream(gemm_stream):
            for h in (0, 1):
                halves[h][0]()
                qkv_done[h].record(gemm_stream)
        for layer in range(layers):
            with torch.cuda.stream(attn_stream):
                for h in (0, 1):
                    attn_stream.wait_event(qkv_done[h])
                    attention[h][layer]()
                    attn_done[h].record(attn_stream)
            with torch.cuda.stream(gemm_stream):
                for h in (0, 1):
                    gemm_stream.wait_event(attn_done[h])
                    for call in halves[h][4 * layer + 1 : 4 * layer + 4]:
                        call()
                    if layer + 1 < layers:
                        halves[h][4 * layer + 4]()
                        qkv_done[h].record(gemm_stream)
        main.wait_stream(attn_stream)
        main.wait_stream(gemm_stream)

    return run


def main() -> int:
    parser = probe_parser(__doc__)
    parser.add_argument("--green", required=True, help="SM counts for the attention (above)")
    parser.add_argument("--pipeline", action="store_true", help="(above)")
    args = parser.parse_args()
    result = green(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows_per_half": args.rows,
                       "context": args.context, "green": result}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
