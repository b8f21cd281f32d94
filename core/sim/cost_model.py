"""The step-time cost model: what one engine step costs on the GPU, from what it does.

A step's time is a sum of physically motivated terms, each the time the step's work
would take at the hardware's nominal rates, times a fitted coefficient (the inverse
of the efficiency reached on that term):

    t = c_const                                  per-step overhead (launches, sampling, host)
      + c_eager * [step not in a CUDA graph]     extra kernel launches of an eager step
      + c_gemm  * max(W / BW, T_pad * F / PEAK)  linear layers: weight bytes or FLOPs (roofline)
      + c_flops * T_pad * F / PEAK               what large GEMMs lose below peak
      + c_kv    * K * kv_bytes / BW              KV cache read by attention
      + c_attn  * P * attn_flops / PEAK          attention FLOPs over (query, key) pairs
      + c_seq   * S                              per-sequence work (block tables, sampling rows)

With ``launch_overlap`` (every model ``tokenloom bench calibrate`` fits since the second
H200 calibration), an eager step takes the longer of its kernel launches and its GPU
work instead of their sum: the Python forward queues kernels while the GPU runs the
ones already queued, so a small eager step (a short prefill: ~11 ms on an H200 whatever
its length up to ~1k tokens for Qwen3-0.6B, ~9 ms for Llama-3-8B) costs its launches,
and a large one (an 8k-token prefill chunk) its GPU work, the launches hidden:

    t = c_const + max(c_eager, gpu)  for an eager step,   c_const + gpu  for a graph step

where ``gpu`` is the sum of the other terms. On the 2026-12-01 H200 samples this form
cut Llama-3-8B's prefill error from 6.4% to 2.2% (mean) and 15.5% to 7.9% (max): the
additive form had to shrink the GEMM coefficient to fit the small eager steps, and so
under-predicted the 8k-token chunks by ~10%.

``W`` weight bytes (the embedding is a gather, an untied head is read in full), ``F``
linear FLOPs per token, ``T_pad`` the step's tokens (a decode-only step replays the
CUDA graph of the smallest captured batch size >= its sequences, so it pays for the
padded rows), ``K`` context tokens read (every chunk reads its whole prefix), ``P``
attended (query, key) pairs, ``S`` sequences. ``BW`` and ``PEAK`` are the nominal
H200 rates; the coefficients absorb what the kernels reach. The coefficients come
from least squares on measured steps (``tokenloom bench calibrate``); ``fit``
does it here, so the fit is reproducible from the JSON of measurements.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from tokenloom.protocols.step import StepInput

H200_BANDWIDTH = 4.2e12  # bytes/s, measured device copy (docs/performance.md)
H200_PEAK_FLOPS = 790e12  # dense bf16 FLOP/s
TERMS = ("const", "eager", "gemm", "flops", "kv", "attn", "seq")
DATA_DIR = Path(__file__).parent / "data"


class ModelShape(msgspec.Struct, frozen=True):
    """What the cost model needs to know of a model: bytes and FLOPs per token."""

    name: str
    weight_bytes: float  # read once per step by the linear layers
    flops_per_token: float  # linear layers, per computed token (head excluded)
    head_flops: float  # the LM head, per sampled token
    kv_bytes_per_token: float  # K and V over all layers
    attn_flops_per_pair: float  # QK^T and PV over all layers and query heads

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any], dtype_bytes: int = 2) -> ModelShape:
        h = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        head_dim = cfg.get("head_dim", h // heads)
        vocab = cfg["vocab_size"]
        attn = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim
        per_layer = attn + 3 * h * cfg["intermediate_size"]
        head = vocab * h
        return cls(
            name=name,
            weight_bytes=float(dtype_bytes * (layers * per_layer + head)),
            flops_per_token=2.0 * layers * per_layer,
            head_flops=2.0 * head,
            kv_bytes_per_token=float(2 * layers * kv_heads * head_dim * dtype_bytes),
            attn_flops_per_pair=4.0 * layers * heads * head_dim,
        )

    @classmethod
    def named(cls, name: str) -> ModelShape:
        from tokenloom.checkpoints.model_shapes import SHAPES

        if name not in SHAPES:
            raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
        return cls.from_hf_config(name, SHAPES[name])


class StepFeatures(msgspec.Struct, array_like=True, gc=False):
    """What one step does, as the cost model reads it (one row of a calibration)."""

    num_seqs: int
    num_tokens: int
    num_decodes: int  # one-token chunks
    context_tokens: int  # sum over chunks of the chunk's end position (KV read)
    attn_pairs: int  # sum over chunks of attended (query, key) pairs
    num_sampled: int
    graph_batch: int = 0  # the CUDA-graph batch size replayed; 0 = eager step

    @property
    def step_class(self) -> str:
        if self.num_decodes == self.num_seqs:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"


def graph_batch(num_seqs: int, sizes: Sequence[int]) -> int:
    """The captured batch size a decode-only step of ``num_seqs`` replays (0: none fits)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return 0


def graph_sizes(max_num_seqs: int, max_graph_batch: int = 512) -> list[int]:
    """The executor's CUDA-graph batch sizes (``plugins.executor.cuda_graphs``),
    restated so the simulator does not import torch."""
    top = min(max_num_seqs, max_graph_batch)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class CostModel(msgspec.Struct):
    """A fitted (or derived) step-time model for one model shape on one GPU."""

    shape: ModelShape
    coefficients: dict[str, float]  # term -> coefficient (seconds for const/eager/seq)
    bandwidth: float = H200_BANDWIDTH
    peak_flops: float = H200_PEAK_FLOPS
    device: str = "NVIDIA H200"
    source: str = ""  # how the coefficients were obtained
    fit_error: dict[str, dict[str, float]] = {}  # step class -> error figures
    launch_overlap: bool = False  # an eager step costs max(launches, GPU work), not the sum

    def terms(self, f: StepFeatures) -> list[float]:
        """The physical terms of ``f`` in seconds (``const`` and ``eager`` as 1/0,
        ``seq`` as a count), in the order of ``TERMS``."""
        s = self.shape
        tokens = f.graph_batch if f.graph_batch else f.num_tokens
        flops = (tokens * s.flops_per_token + f.num_sampled * s.head_flops) / self.peak_flops
        return [
            1.0,
            0.0 if f.graph_batch else 1.0,
            max(s.weight_bytes / self.bandwidth, flops),
            flops,
            f.context_tokens * s.kv_bytes_per_token / self.bandwidth,
            f.attn_pairs * s.attn_flops_per_pair / self.peak_flops,
            float(f.num_seqs),
        ]

    def step_time(self, f: StepFeatures) -> float:
        """Predicted seconds for one step."""
        c = self.coefficients
        parts = [c.get(name, 0.0) * x for name, x in zip(TERMS, self.terms(f), strict=True)]
        if not self.launch_overlap:
            return sum(parts)
        return parts[0] + max(parts[1], sum(parts[2:]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(msgspec.to_builtins(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

    @classmethod
    def shipped(cls, name: str) -> CostModel:
        """The model shipped for shape ``name`` (``data/<name>.json``)."""
        path = DATA_DIR / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in DATA_DIR.glob("*.json"))
            raise ValueError(f"no shipped cost model {name!r}; known: {', '.join(known)}")
        return cls.load(path)


def nnls(a: Any, b: Any, iterations: int = 200) -> Any:
    """Non-negative least squares, ``min |a x - b|`` with ``x >= 0`` (Lawson-Hanson).

    Columns are scaled to unit norm first: the cost terms span seconds (``const``) to
    sequence counts (``seq``, hundreds), and an unscaled active set picks which term to
    free by magnitude, not by how much it would help. Unlike dropping every term whose
    unconstrained coefficient is negative, a dropped term can come back."""
    import numpy as np

    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        grad = a.T @ (b - a @ x)
        candidates = np.where(~free & (grad > 1e-12))[0]
        if not len(candidates):
            break
        free[candidates[np.argmax(grad[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            step = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + step * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x / norms


def fit(
    shape: ModelShape,
    samples: Iterable[tuple[StepFeatures, float]],
    *,
    bandwidth: float = H200_BANDWIDTH,
    peak_flops: float = H200_PEAK_FLOPS,
    source: str = "",
    launch_overlap: bool = True,
) -> CostModel:
    """Least squares on measured ``(features, seconds)`` pairs, relative error weighted
    (each row divided by its time, so a 5 ms decode counts as much as a 200 ms
    prefill). Coefficients are kept non-negative (``nnls``), since a negative cost has
    no physical meaning. Terms no sample exercises are left out of the fit.

    With ``launch_overlap`` the model is piecewise linear (an eager step pays
    ``max(c_eager, gpu)``). Launch-bound steps all take ``const + eager``, the least
    any eager step takes, so for each threshold on the eager steps' measured times the
    ones at or below it are fitted as launch-bound (``const + eager``) and the rest as
    GPU-bound (``const + gpu``); the best split by the piecewise model's own weighted
    error is kept, then refined by moving each step to its larger side while that
    lowers the error.

    Relative weighting trusts every measured time: one step measured at a fraction of
    its true time outweighs dozens of good ones (issue 13: three mixed steps measured
    at 0.8-1.8 ms zeroed the weight-read term). Screen samples with ``implausible``
    first."""
    import numpy as np

    rows = list(samples)
    if len(rows) < len(TERMS):
        raise ValueError(f"need at least {len(TERMS)} measured steps, got {len(rows)}")
    probe = CostModel(shape, {}, bandwidth, peak_flops)
    x = np.array([probe.terms(f) for f, _ in rows])
    y = np.array([t for _, t in rows])
    weights = 1.0 / y

    def solve(a: Any) -> Any:
        active = [i for i in range(len(TERMS)) if np.any(a[:, i] != a[0, i]) or i == 0]
        coef = np.zeros(len(TERMS))
        coef[active] = nnls(a[:, active] * weights[:, None], y * weights)
        return coef

    coef = solve(x)
    if launch_overlap:
        eager = x[:, 1] > 0

        def split(launch_bound: Any) -> Any:
            a = x.copy()
            a[~launch_bound, 1] = 0.0  # GPU-bound: const + gpu terms
            a[launch_bound, 2:] = 0.0  # launch-bound: const + eager
            return solve(a)

        def loss(c: Any) -> float:
            gpu = x[:, 2:] @ c[2:]
            pred = c[0] + np.where(eager, np.maximum(c[1], gpu), gpu)
            return float(np.sum(((pred - y) * weights) ** 2))

        # Launch-bound steps are the fastest eager ones (they all take const + eager):
        # try every time threshold, keep the best, then let each step move to its
        # larger side until none does.
        best = coef
        for threshold in np.unique(y[eager]):
            candidate = split(eager & (y <= threshold))
            if loss(candidate) < loss(best):
                best = candidate
        coef = best
        for _ in range(50):
            launch_bound = eager & (coef[1] > x[:, 2:] @ coef[2:])
            again = split(launch_bound)
            if loss(again) >= loss(coef):
                break
            coef = again
    model = CostModel(
        shape,
        {name: float(c) for name, c in zip(TERMS, coef, strict=True)},
        bandwidth,
        peak_flops,
        source=source,
        launch_overlap=launch_overlap,
    )
    model.fit_error = fit_errors(model, rows)
    return model


def implausible(
    shape: ModelShape, samples: Iterable[tuple[StepFeatures, float]], bandwidth: float
) -> list[int]:
    """Indices of samples measured faster than physics allows: every step reads all
    the weights once, so no step takes less than ``weight_bytes / bandwidth`` (3.5 ms
    for Llama-3-8B on an H200). Such a time was not the step's (a host-side gap)."""
    floor = shape.weight_bytes / bandwidth
    return [i for i, (_, seconds) in enumerate(samples) if seconds < floor]


def fit_errors(
    model: CostModel, samples: Iterable[tuple[StepFeatures, float]]
) -> dict[str, dict[str, float]]:
    """Per step class (decode, prefill, mixed, all): number of steps, mean and max
    absolute relative error of the prediction."""
    by_class: dict[str, list[float]] = {}
    for f, seconds in samples:
        err = abs(model.step_time(f) - seconds) / seconds
        by_class.setdefault(f.step_class, []).append(err)
        by_class.setdefault("all", []).append(err)
    return {
        name: {"steps": len(errs), "mean_rel_err": sum(errs) / len(errs), "max_rel_err": max(errs)}
        for name, errs in by_class.items()
    }


def step_features(step: StepInput, sizes: Sequence[int]) -> StepFeatures:
    """What ``step`` does, read from its chunks alone (no tensors). ``sizes`` are the
    CUDA-graph batch sizes (empty when the executor runs eagerly)."""
    num_tokens = num_decodes = context = pairs = sampled = 0
    for chunk in step.chunks:
        n = len(chunk.token_ids)
        start = chunk.start_pos
        num_tokens += n
        context += start + n
        if n == 1:
            num_decodes += 1
            pairs += start + 1
        else:
            pairs += n * start + n * (n + 1) // 2
        sampled += chunk.sample
    num_seqs = len(step.chunks)
    graph = graph_batch(num_seqs, sizes) if sizes and num_decodes == num_seqs else 0
    return StepFeatures(num_seqs, num_tokens, num_decodes, context, pairs, sampled, graph)
