"""The default cost models, derived from recorded H200 measurements (not calibrated).

Until ``tokenloom bench calibrate`` has run on the GPU, the simulator needs a model.
This module derives one per shape from the figures recorded in
``docs/performance.md`` and ``docs/results/*.json`` (v5, one H200, bf16, random
weights), and says how each coefficient was pinned:

- ``gemm``: the profile's GEMM time of a batch-1 Llama-3-8B decode step (~3.7 ms)
  over its weight bytes at the measured copy bandwidth (3.57 ms);
- ``const``: the rest of the batch-1 decode step (4.46 ms Llama-3-8B, 1.22 ms
  Qwen3-0.6B, ``step_ms`` of ``latency-*-v5.json``): small kernels, launch gaps;
- ``attn``: prefill attention at 288 TFLOP/s (the profile: 57% of flash SDPA);
- ``flops``: the 8,192-token mixed steps of the throughput workload at ~191 ms;
- ``kv``, ``seq``, ``eager``: not measured separately; ``kv`` is chosen (by
  ``derive``, a one-dimensional search) so that the simulated offline throughput
  workload matches the recorded output tokens/s; ``eager`` and ``seq`` are 0
  (async scheduling hides the host's per-step and per-sequence work).

``python -m tokenloom.sim.derived`` rewrites ``data/<shape>.json``; the tests check
that the shipped files still reproduce the measurements they were derived from.
"""

from __future__ import annotations

from typing import Any

from tokenloom.sim.cost_model import DATA_DIR, CostModel, ModelShape, StepFeatures

# The recorded figures (docs/results/*-v5.json, docs/performance.md "What limits the rest").
MEASURED: dict[str, dict[str, float]] = {
    "llama-3-8b": {
        "decode_step_s": 4.460e-3,  # latency-llama-v5.json step_ms
        "gemm_s": 3.7e-3,  # profile: GEMMs ~3.7 ms of the batch-1 step
        "mixed_8192_step_s": 0.191,  # v3 profile_throughput: 8,192-token steps
        "throughput_tok_s": 10096.2,  # throughput-llama-v5.json
        "kv_gib": 108.744,
    },
    "qwen3-0.6b": {
        "decode_step_s": 1.217e-3,  # latency-qwen3-v5.json step_ms
        "throughput_tok_s": 22662.8,  # throughput-qwen3-v5.json
        "kv_gib": 123.202,
    },
}
_PLUGINS: Any = None
PREFILL_ATTENTION_FLOPS = 288e12  # the profile's prefill attention rate
SOURCE = (
    "derived from recorded H200 measurements (docs/performance.md, docs/results/*-v5.json), "
    "not calibrated: run `tokenloom bench calibrate` on the GPU"
)


def num_blocks(shape: ModelShape, kv_gib: float, block_size: int = 16) -> int:
    return int(kv_gib * 2**30 // (block_size * shape.kv_bytes_per_token))


def base_model(name: str, llama_flops: float | None = None) -> CostModel:
    """The coefficients pinned by single figures (all but ``kv``)."""
    shape = ModelShape.named(name)
    probe = CostModel(shape, {})
    weights_s = shape.weight_bytes / probe.bandwidth
    llama = MEASURED["llama-3-8b"]
    gemm = llama["gemm_s"] / (ModelShape.named("llama-3-8b").weight_bytes / probe.bandwidth)
    const = MEASURED[name]["decode_step_s"] - gemm * weights_s
    coefficients = {
        "const": const,
        "eager": 0.0,
        "gemm": gemm,
        "flops": 0.0,
        "kv": 1.0,
        "attn": probe.peak_flops / PREFILL_ATTENTION_FLOPS,
        "seq": 0.0,
    }
    model = CostModel(shape, coefficients, source=SOURCE)
    # flops: what an 8,192-token prefill step costs beyond the other terms (from the
    # Llama-3-8B profile; the same GEMM efficiency is assumed for the other shapes).
    if llama_flops is None:
        ref = CostModel(ModelShape.named("llama-3-8b"), dict(coefficients), source=SOURCE)
        ref.coefficients["const"] = llama["decode_step_s"] - llama["gemm_s"]
        step = mixed_step()
        rest = ref.step_time(step)
        flops_s = ref.terms(step)[3]
        llama_flops = (llama["mixed_8192_step_s"] - rest) / flops_s
    coefficients["flops"] = llama_flops
    return model


def mixed_step() -> StepFeatures:
    """An 8,192-token prefill step of the throughput workload: ~14 whole prompts of
    ~562 tokens (lengths uniform in 100..1024), eager."""
    n, length = 14, 8192 // 14
    pairs = n * length * (length + 1) // 2
    return StepFeatures(n, 8192, 0, 8192, pairs, n, 0)


def simulated_throughput(model: CostModel, kv_gib: float) -> float:
    """Output tokens/s of ``tokenloom bench throughput``'s workload, simulated."""
    from tokenloom.config import EngineConfig
    from tokenloom.plugin_manager import PluginManager
    from tokenloom.sim.metrics import summarize
    from tokenloom.sim.simulator import simulate
    from tokenloom.sim.workload import TraceRequest, make_workload

    work = make_workload(256, 100, 1024, 32000, 0)
    trace = [TraceRequest(0.0, len(ids), n) for ids, n in work]
    config = EngineConfig(
        model=model.shape.name,
        max_model_len=8192,
        num_blocks=num_blocks(model.shape, kv_gib),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    global _PLUGINS
    _PLUGINS = _PLUGINS or PluginManager.default()
    result = simulate(trace, config, model, _PLUGINS)
    return float(summarize(result.requests)["output_token_throughput"])


def derive(name: str) -> tuple[CostModel, dict[str, Any]]:
    """The default model of ``name`` and the figures it reproduces."""
    model = base_model(name)
    target = MEASURED[name]["throughput_tok_s"]
    kv_gib = MEASURED[name]["kv_gib"]
    low, high = 0.5, 8.0  # throughput falls as the KV coefficient grows
    for _ in range(14):
        mid = (low + high) / 2
        model.coefficients["kv"] = mid
        if simulated_throughput(model, kv_gib) > target:
            low = mid
        else:
            high = mid
    model.coefficients["kv"] = (low + high) / 2
    check = {
        "decode_step_s": model.step_time(StepFeatures(1, 1, 1, 256, 256, 1, 1)),
        "throughput_tok_s": simulated_throughput(model, kv_gib),
        "measured": MEASURED[name],
    }
    if name == "llama-3-8b":
        check["mixed_8192_step_s"] = model.step_time(mixed_step())
    return model, check


def main() -> int:
    import json

    for name in MEASURED:
        model, check = derive(name)
        model.fit_error = {}
        model.save(DATA_DIR / f"{name}.json")
        print(name, json.dumps(model.coefficients), json.dumps(check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
