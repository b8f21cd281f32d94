"""The two ways kernels are timed on the GPU, in one place: the tuners (the skinny GEMM,
the quantized GEMM/GEMV, the all-reduce choice), the benches and the profiling scripts
all use these, so every figure they report is taken the same way (warm-up first, CUDA
events, the median); and ``fastest_config``, the tuners' search over kernel configs."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("tokenloom.models")


def median_cuda_us(fn: Callable[[], Any], iters: int = 30) -> float:
    """Median microseconds of ``fn`` on the device (CUDA events around each call, launch
    overhead included), after a warm-up of 5 calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """One side stream per device for ``time_graph``'s warm-up. A new
    ``torch.cuda.Stream()`` per call cycles through the pool's 32 streams, and cuBLAS
    keeps a workspace (32 MiB on an H200) for every stream it has run on. Session 10:
    with the int4 tuner timing the dequantization tiling (cuBLAS) on four shapes, the
    memory allocated after load grew by 0.19 GiB more than the weights and the buffer,
    6 x 32 MiB to within 1%. That this is the cause is an inference, checked by
    ``test_cuda_timing.py`` on the next GPU run."""
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream()
    return _SIDE_STREAMS[device]


def time_graph(fn: Callable[[], Any], repeats: int = 20, rounds: int = 5) -> float:
    """Median microseconds per call of ``fn`` replayed in a CUDA graph (launch overhead
    excluded, as in decode steps): one call outside the capture compiles it, then
    ``repeats`` calls are captured and the graph is replayed ``rounds`` times."""
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return sorted(times)[len(times) // 2]


def fastest_config(
    configs: list[tuple[int, int, int]],
    run: Callable[[tuple[int, int, int]], torch.Tensor],
    expected: torch.Tensor,
    baseline_us: float,
    timer: Callable[[Callable[[], object]], float],
) -> tuple[tuple[int, int, int] | None, float]:
    """Of ``configs``, the one whose ``run(config)`` agrees with ``expected`` (1e-2
    relative) and times fastest (``timer``), if it beats 0.97 x ``baseline_us``; with
    its time (else None and the 0.97 x baseline bar)."""
    best, best_time = None, 0.97 * baseline_us
    for config in configs:
        try:
            got = run(config).float()
            if float((got - expected).norm() / expected.norm()) > 1e-2:
                raise ValueError("disagrees with the reference")
            t = timer(lambda c=config: run(c))
        except Exception as err:  # a tile this GPU or Triton cannot run
            log.debug("config %s failed on %s: %s", config, tuple(expected.shape), err)
            continue
        if t < best_time:
            best, best_time = config, t
    return best, best_time
