"""The simulator's quantized settings: fp8 weights (W8A8) and an fp8 KV cache.

The shipped cost models are fitted on bf16 steps. With fp8 three things change, each
taken from an H200 measurement, none fitted to the throughput it is then checked
against:

- **bytes**: the decoder's linears at one byte a weight (the LM head stays 16-bit, as
  the engine keeps it without ``--quant-lm-head``); the KV cache at one byte an element;
- **GEMM rate**: dense fp8 GEMMs at 1,385 TFLOP/s against 784 in bf16 (the peaks
  ``scripts/kernel_classes.py`` measures, ``docs/performance.md``): the linears' FLOPs
  count ``1 / FP8_GEMM_SPEEDUP`` of their bf16 time;
- **efficiency**: decode attention over an fp8 cache ran at 1.77x its KV floor with the
  f16-converting kernel (session 8 profile, 512 sequences x 1,500 tokens: 21.9 ms against
  12.4) where bf16's ran at 0.96x (session 13, 256 x 1,500: 11.68 ms against 12.20):
  ``FP8_KV_FACTOR_F16``. The fp8-MMA decode, the default since session 32, took 601.9 us
  a layer at 512 x 1,500 against that kernel's 665.1 in the same bench (``FP8_MMA_GAIN``);
  its own tiles (``MMA_DECODE``, session 37: 602.6 -> 578.6 us, ``FP8_MMA_TILES_GAIN``)
  and one cross-warp reduction a tile (session 38: 559.2 -> 523.3 us,
  ``FP8_FOLD_GAIN``), each measured against the kernel before it on one H200, took it
  further. The ``kv`` coefficient grows by ``FP8_KV_FACTOR``, their product (x 1.50; 1.77
  x 0.905 x 0.960 x 0.936 = 1.44x the floor in session 8's terms). The fp8 GEMMs plus the
  activations' quantization took 7.0 ms at 512 rows (6.3 + 0.72) where the bf16
  coefficients predict 6.39 at the fp8 rate, so ``gemm`` and ``flops`` grow by
  ``FP8_GEMM_FACTOR``.
- **page size**: an fp8 cache's blocks hold 64 tokens by default since session 51; the
  fp8-MMA decode then took 600.3 us a layer at 512 x 1,500 against 663.5 at pages of 16
  (128: 637.9), measured on an H100 (session 51; the H200 has not run it):
  ``FP8_PAGE_GAIN`` scales the ``kv`` coefficient by page size. Other page sizes are
  refused, as the unmeasured settings below are.

Checked against the engine (``tests/core/sim/test_quantized.py``): issue 12's workload
(600 x 1,000 in / 1,000 out at once, fp8 weights and KV, 114,348 blocks) at
``max_num_seqs`` 640 with 640-row graphs, pages of 16. Today's decode (session 38, three
calls on one H200) measured 14,089, 14,093 and 14,117 out tok/s; simulated 13,844 (-1.7%
to -1.9%). Session 37's (without the fold; 13,627 and 13,658 on the same machine)
simulates 13,382 (-1.8%, -2.0%). Session 32's fp8-MMA decode measured 13,265 and 13,463 (two calls);
simulated 13,099. With ``FP8_KV_FACTOR_F16`` (the f16-converting kernel), measured 12,023
at 512 and 12,756 at 640 (session 9), 12,879 and 12,801 at 640 (session 32); simulated
11,792 and 12,408. In blocks of 64 (the default) the lab gives 14,541 (not yet measured
on an H200).

int8 and int4 weights and an int8 cache are refused: their kernels' efficiency at decode
batches has no measurement in a form this model can take.
"""

from __future__ import annotations

from msgspec import structs

from tokenloom.sim.cost_model import CostModel

QUANTS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_GEMM_SPEEDUP = 1385 / 784
FP8_KV_FACTOR_F16 = (21.9 / 12.4) / (11.68 / 12.20)
FP8_MMA_GAIN = 601.9 / 665.1  # session 32: the fp8-MMA decode against the f16 one
FP8_MMA_TILES_GAIN = 578.6 / 602.6  # session 37: MMA_DECODE's tiles
FP8_FOLD_GAIN = 523.3 / 559.2  # session 38: one cross-warp reduction a tile
FP8_KV_FACTOR = FP8_KV_FACTOR_F16 * FP8_MMA_GAIN * FP8_MMA_TILES_GAIN * FP8_FOLD_GAIN
FP8_GEMM_FACTOR = (6.3 + 0.72) / 6.39
FP8_PAGE_GAIN = {16: 1.0, 64: 600.3 / 663.5, 128: 637.9 / 663.5}  # H100, session 51
H200_GIB = 139.80  # total memory the engine's start-up log reports on the H200


def apply(
    cost: CostModel, quant: str = "none", kv_cache_dtype: str = "auto", block_size: int = 0
) -> CostModel:
    """``cost`` for fp8 weights and/or an fp8 KV cache in blocks of ``block_size``
    tokens (0: the engine's default for that cache; see the module docstring)."""
    from tokenloom.config import default_block_size

    block_size = block_size or default_block_size(kv_cache_dtype)
    if quant not in QUANTS:
        raise ValueError(f"the simulator models --quant {' | '.join(QUANTS)}, not {quant!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"the simulator models --kv-cache-dtype {' | '.join(KV_CACHE_DTYPES)}, "
            f"not {kv_cache_dtype!r}"
        )
    shape, coefficients = cost.shape, dict(cost.coefficients)
    notes = []
    if quant == "fp8":
        linear_params = shape.flops_per_token / 2  # two FLOPs per weight per token
        shape = structs.replace(
            shape,
            weight_bytes=shape.weight_bytes - linear_params,  # 2 -> 1 byte a weight
            flops_per_token=shape.flops_per_token / FP8_GEMM_SPEEDUP,
        )
        coefficients["gemm"] = coefficients.get("gemm", 0.0) * FP8_GEMM_FACTOR
        coefficients["flops"] = coefficients.get("flops", 0.0) * FP8_GEMM_FACTOR
        notes.append("fp8 weights")
    if kv_cache_dtype == "fp8":
        if block_size not in FP8_PAGE_GAIN:
            raise ValueError(
                f"the simulator models an fp8 cache in blocks of "
                f"{' | '.join(map(str, FP8_PAGE_GAIN))} tokens, not {block_size}"
            )
        shape = structs.replace(shape, kv_bytes_per_token=shape.kv_bytes_per_token / 2)
        coefficients["kv"] = coefficients.get("kv", 0.0) * FP8_KV_FACTOR
        coefficients["kv"] *= FP8_PAGE_GAIN[block_size]
        notes.append(f"fp8 KV cache in blocks of {block_size}")
    if not notes:
        return cost
    source = f"{cost.source}; {', '.join(notes)} per tokenloom.sim.quantized"
    return structs.replace(cost, shape=shape, coefficients=coefficients, source=source)


def default_blocks(
    shape: str, quant: str, kv_cache_dtype: str, max_num_seqs: int, block_size: int
) -> int:
    """The KV blocks the engine would allocate on an H200 for this setting, from the
    memory planner (``tokenloom plan``, within 0.1% of the engine's start-up logs)."""
    from tokenloom.config import EngineConfig
    from tokenloom.entrypoints.plan import make_plan

    config = EngineConfig(
        model=shape,
        quant=quant,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
    )
    return make_plan(config, H200_GIB, advice=False).num_kv_blocks
