"""``scripts/kernel_fingerprint.py``: the Triton kernels a test run launches, recorded
under the interpreter, compiled for sm_90 without a GPU and hashed, so that two trees'
machine code can be compared."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "kernel_fingerprint.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = [
    pytest.mark.skipif(not PTXAS.exists(), reason="Triton's NVIDIA backend is absent"),
    pytest.mark.slow,
]
KV_WRITE = "tokenloom.plugins.attention.triton_kernels.kv_write:_kv_write_quant_kernel"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_launches_are_recorded_compiled_for_sm90_and_compared(tmp_path):
    specs, first, second = tmp_path / "specs.pkl", tmp_path / "a.json", tmp_path / "b.json"
    test = "tests/plugins/attention/test_kv_quant.py::test_triton_kv_write_stores_what_the_reference_stores"
    rec = _run("record", str(specs), "--", test, "-q")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    recorded = pickle.loads(specs.read_bytes())
    kv = [s for s in recorded.values() if s["kernel"] == KV_WRITE]
    # the test's fp8 cache in both value layouts and its int8 cache (values as stored:
    # only fp8 pools transpose them), each over pages of 16 and of 64 tokens: six
    # specializations of the write
    assert len(kv) == 6
    assert sorted(
        (s["signature"]["k_cache_ptr"], s["constexpr_names"]["V_T"], s["constexpr_names"]["PAGE_SIZE"])
        for s in kv
    ) == [("*fp8e4nv", False, 16), ("*fp8e4nv", False, 64), ("*fp8e4nv", True, 16),
          ("*fp8e4nv", True, 64), ("*i8", False, 16), ("*i8", False, 64)]  # fmt: skip
    # Triton's run-time specialization: 16-byte aligned pointers are marked so
    assert all(["tt.divisibility", 16] in s["attrs"][(0,)] for s in kv)
    assert all("num_warps" in s["options"] for s in kv)

    for out in (first, second):
        comp = _run("compile", str(specs), str(out))
        assert comp.returncode == 0, comp.stdout + comp.stderr
    prints = json.loads(first.read_text())["kernels"]
    assert len(prints) == len(recorded)
    one = next(v for v in prints.values() if v["kernel"] == KV_WRITE)
    assert len(one["sass_sha256"]) == 64 and one["instructions"] > 50 and one["registers"] > 0

    same = _run("diff", str(first), str(second))  # the same tree compiles to the same SASS
    assert same.returncode == 0 and " 0 changed, 0 in one tree only" in same.stdout

    # a kernel moved to another module, its machine code the same, meets itself
    data = json.loads(second.read_text())
    key = next(k for k, v in data["kernels"].items() if v["kernel"] == KV_WRITE)
    value = data["kernels"].pop(key)
    data["kernels"][key.replace(":", "_moved:", 1)] = {**value, "kernel": KV_WRITE + "_moved"}
    (tmp_path / "moved.json").write_text(json.dumps(data))
    moved = _run("diff", str(first), str(tmp_path / "moved.json"))
    assert moved.returncode == 0, moved.stdout
    assert "(1 of them moved), 0 changed, 0 in one tree only" in moved.stdout

    data = json.loads(second.read_text())
    keys = sorted(k for k, v in data["kernels"].items() if v["kernel"] == KV_WRITE)
    data["kernels"][keys[0]]["sass_sha256"] = "0" * 64
    data["kernels"][keys[1]]["registers"] += 2
    del data["kernels"][keys[2]]
    second.write_text(json.dumps(data))
    changed = _run("diff", str(first), str(second))
    assert changed.returncode == 1
    assert f"changed  {keys[0]}: SASS differs" in changed.stdout
    assert f"changed  {keys[1]}: SASS same; registers" in changed.stdout
    assert f"before only  {keys[2]}" in changed.stdout


def test_compare_installs_a_revision_and_finds_the_same_machine_code():
    # HEAD against the working tree, on one test's launches: the kernels a change of
    # this session's kind (tests, docs, scripts) leaves alone compile to the same SASS
    test = "tests/plugins/attention/test_kv_quant.py::test_triton_kv_write_stores_what_the_reference_stores"
    kernels = ROOT / "plugins" / "attention" / "triton_kernels"
    dirty = subprocess.run(["git", "status", "--porcelain", str(kernels)], cwd=ROOT,
                           capture_output=True, text=True)  # fmt: skip
    if dirty.returncode != 0:
        pytest.skip("not a git checkout")
    if dirty.stdout.strip():
        pytest.skip("the attention kernels have uncommitted changes")
    done = _run("compare", "HEAD", "--", test, "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "before (HEAD): recorded 6 launch specializations" in done.stdout
    assert (
        "6 launch specializations identical (0 of them moved), 0 changed, 0 in one" in done.stdout
    )


def test_every_attention_kernel_launch_of_its_tests_compiles_for_sm90(tmp_path):
    # The interpreter runs kernels the GPU's compiler rejects: session 51's first scalar
    # block number had two returns of different types under a constexpr `if`, which the
    # interpreter ran and Triton's compiler refused, only for pages of whole tiles. Every
    # launch the fp8-MMA decode's and the quantized cache's tests make (page sizes, folds,
    # block numbers ahead, cache dtypes and value layouts) compiles for sm_90 here.
    specs, prints = tmp_path / "specs.pkl", tmp_path / "prints.json"
    tests = [
        "tests/plugins/attention/test_decode_fp8_mma.py",
        "tests/plugins/attention/test_kv_quant.py",
        "tests/plugins/attention/test_kv_quant_prefill.py",
    ]
    rec = _run("record", str(specs), "--", *tests, "-q")
    assert rec.returncode == 0, rec.stdout[-2000:] + rec.stderr[-2000:]
    recorded = pickle.loads(specs.read_bytes())
    pages = {s["constexpr_names"].get("PAGE_SIZE") for s in recorded.values()}
    assert {16, 32, 64, 128} <= pages  # the tests reach every page size they name
    # and the fp8-MMA prefill (session 52), at pages of 16 and 64
    mma_pages = {
        s["constexpr_names"].get("PAGE_SIZE")
        for s in recorded.values()
        if s["constexpr_names"].get("KV_MMA8")
    }
    assert {16, 64} <= mma_pages
    assert any(s["constexpr_names"].get("AHEAD") for s in recorded.values())
    comp = _run("compile", str(specs), str(prints))
    assert comp.returncode == 0, comp.stdout[-3000:]
    assert f"compiled {len(recorded)} of {len(recorded)} for sm_90" in comp.stdout


Q, M = "tests/plugins/quant", "tests/plugins/models"
# the other kernels' tests in two groups, and the kernels each group must reach
KERNEL_GROUPS = {
    "weight-gemm": (
        [f"{Q}/test_weight_gemm.py", f"{Q}/test_dequant.py", f"{Q}/test_fp8_gemv.py",
         f"{Q}/test_fp8_quant.py", f"{Q}/test_gemv_small_groups.py"],
        {"_dequant_kernel", "_fp8_gemv_kernel", "_per_token_fp8_kernel", "_split_sum_kernel",
         "_weight_gemm_kernel", "_weight_gemv_kernel", "_weight_gemv_rows_kernel"},
    ),
    "gemv-norm-sampling": (
        [f"{M}/test_fused_ops.py", f"{M}/test_fused_gemv.py", f"{M}/test_skinny_gemm.py",
         f"{M}/test_fp8_fold_quant.py", "tests/plugins/executor/test_graph_inputs.py",
         "tests/plugins/executor/sampling", f"{Q}/test_int4_gemv_nk.py",
         f"{Q}/test_int4_gemv_mma.py", f"{Q}/test_int4_gemv_h2.py", f"{Q}/test_int8_gemv_nk.py",
         f"{Q}/test_int4_qkv_rope.py"],
        {"_int4_gemv_nk_kernel", "_int4_gemv_mma_kernel", "_int4_gemv_h2_kernel",
         "_int8_gemv_nk_kernel", "_norm_gemv_kernel", "_add_rms_norm_kernel", "_gemv_kernel",
         "_skinny_gemm_kernel", "_silu_and_mul_kernel", "_silu_and_mul_fp8_kernel",
         "_gather_columns_kernel", "_qk_norm_rope_kernel", "_gumbel_max_kernel",
         "_reduce_splits_kernel", "_scatter_decode_inputs_kernel"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("group", sorted(KERNEL_GROUPS))
def test_every_launch_of_the_other_kernels_tests_compiles_for_sm90(group, tmp_path):
    # The same guard over the weight GEMMs / GEMVs, the fused norms, SiLU, rope and
    # GEMVs, sampling and graph-input kernels (about 160 and 345 specializations)
    tests, kernels = KERNEL_GROUPS[group]
    specs, prints = tmp_path / "specs.pkl", tmp_path / "prints.json"
    rec = _run("record", str(specs), "--", *tests, "-q")
    assert rec.returncode == 0, rec.stdout[-2000:] + rec.stderr[-2000:]
    recorded = pickle.loads(specs.read_bytes())
    assert kernels <= {s["kernel"].rpartition(":")[2] for s in recorded.values()}
    comp = _run("compile", str(specs), str(prints))
    assert comp.returncode == 0, comp.stdout[-3000:]
    assert f"compiled {len(recorded)} of {len(recorded)} for sm_90" in comp.stdout
