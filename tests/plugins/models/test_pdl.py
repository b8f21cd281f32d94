"""Programmatic dependent launch (``plugins/models/pdl.py``): off on the CPU and when
turned off; on an H200, a chain of the decode path's PDL kernels (norm, int4 GEMVs
with their in-kernel split sums, SiLU, fp8 quantization and GEMV, the bf16 skinny GEMM
and one-row GEMV; an int4, an int8 and a bf16 one-row GEMV releasing before their waits
as the o projection's do, each followed by a norm) replayed in a CUDA graph gives, replay after
replay with new inputs, the bits of the same kernels launched without PDL: a kernel that
read or wrote before its wait would race with the one before it and differ. An int4
model decodes the same tokens with the o projection's early release as without."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.models import pdl


def test_pdl_is_off_on_the_cpu_and_when_turned_off(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl_on(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"USE_PDL": False}


def _chain(x, res, norm_w, gate_up, down, w8, ws8, w16, o8):
    from tokenloom.plugins.models.fused_ops import add_rms_norm, silu_and_mul
    from tokenloom.plugins.models.skinny_gemm import gemv, skinny_gemm
    from tokenloom.plugins.quant.kernels.fp8_gemv import fp8_gemv
    from tokenloom.plugins.quant.kernels.fp8_quant import per_token_fp8

    h, summed = add_rms_norm(x, norm_w, 1e-6, res)
    a = silu_and_mul(gate_up.apply(h, None))
    with pdl.next_reads_weights_first():  # the GEMV releases before its wait: the norm next
        y = down.apply(a, None)
    h2, summed = add_rms_norm(y, norm_w, 1e-6, summed)
    with pdl.next_reads_weights_first():  # the int8 GEMV releasing early, a norm next
        y8 = o8.apply(h2, None)
    h3, _ = add_rms_norm(y8, norm_w, 1e-6, summed)
    q, s = per_token_fp8(h3)
    z = fp8_gemv(q, s, w8, ws8, None, torch.bfloat16)
    with pdl.next_reads_weights_first():  # the bf16 GEMV releasing early, a norm next
        g = gemv(skinny_gemm(z, w16, (32, 256, 4, 4)), w16.t().contiguous(), (8, 512, 4))
    return add_rms_norm(g, norm_w[: g.shape[1]], 1e-6)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_chain_in_a_graph_gives_the_bits_of_the_plain_launches(monkeypatch, spy_early):
    from tokenloom.plugins.models import skinny_gemm
    from tokenloom.plugins.quant.int4 import Int4Kernel, quantize_int4
    from tokenloom.plugins.quant.int8 import Int8Kernel, quantize_int8
    from tokenloom.plugins.quant.kernels import int4_gemv_nk, int8_gemv_nk
    from tokenloom.plugins.quant.kernels.dispatch import bucket
    from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig

    if not pdl.pdl_on(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 (and TOKENLOOM_PDL not 0)")
    monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "1")
    early = spy_early(int4_gemv_nk, int8_gemv_nk, skinny_gemm)
    torch.manual_seed(0)
    dev, dim, inter = "cuda", 4096, 4096
    norm_w = torch.rand(dim, device=dev, dtype=torch.bfloat16) + 0.5
    gate_up = Int4Kernel(*quantize_int4(torch.randn(2 * inter, dim, device=dev).bfloat16()), 128)
    qw, sc, zr = quantize_int4(torch.randn(dim, inter, device=dev).bfloat16() / 8)
    down = Int4Kernel(qw.t().contiguous().t(), sc, zr, 128)  # [N, K / 8], as int4_kernel stores
    nk = GemmConfig(1, 16, 4096, 1, 4, 3, nk=True, dp4a=True)  # int4_gemv_nk, one row
    down.configs = tuple(nk if i == bucket(1) else c for i, c in enumerate(down.configs))
    w8 = (torch.randn(1024, dim, device=dev) * 64).to(torch.float8_e4m3fn)
    ws8 = torch.rand(1024, 1, device=dev) / 1000
    w16 = torch.randn(512, 1024, device=dev).bfloat16() / 32
    o8 = Int8Kernel(*quantize_int8(torch.randn(dim, dim, device=dev) / 64), torch.bfloat16)
    nk8 = GemmConfig(1, 16, 1024, 1, 4, 3, nk=True, biased=True)  # int8_gemv_nk, one row
    o8.configs = tuple(nk8 if i == bucket(1) else c for i, c in enumerate(o8.configs))
    weights = (norm_w, gate_up, down, w8, ws8, w16, o8)
    inputs = [
        (torch.randn(1, dim, device=dev).bfloat16(), torch.randn(1, dim, device=dev).bfloat16())
        for _ in range(20)
    ]
    monkeypatch.setattr(pdl, "ENABLED", False)
    expected = [_chain(x, r, *weights) for x, r in inputs]
    monkeypatch.setattr(pdl, "ENABLED", True)
    static_x, static_r = (t.clone() for t in inputs[0])
    eager = _chain(static_x, static_r, *weights)  # compiles the PDL variants
    torch.testing.assert_close(eager, expected[0], rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = _chain(static_x, static_r, *weights)
    torch.cuda.current_stream().wait_stream(stream)
    for (x, r), want in zip(inputs * 3, expected * 3, strict=True):
        static_x.copy_(x)
        static_r.copy_(r)
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert {int4_gemv_nk.__name__, int8_gemv_nk.__name__, skinny_gemm.__name__} <= set(early)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_an_int4_llama_decodes_the_same_tokens_with_the_o_gemv_releasing_early(
    int4_llama_tokens, monkeypatch, spy_early, eager
):
    # eager: every o projection's one-row tiling forced to int4_gemv_nk, so the early
    # release runs whatever the tuner chose; graphs: as tuned, captured. The release
    # changes no arithmetic: any difference is a race.
    from tokenloom.plugins.quant.kernels import int4_gemv_nk

    if not pdl.pdl_on(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 (and TOKENLOOM_PDL not 0)")
    early = spy_early(int4_gemv_nk)
    monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "1")
    with_early = int4_llama_tokens(eager, "o_proj")
    assert early or not eager  # forced: the o GEMVs took it
    monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "0")
    assert int4_llama_tokens(eager, "o_proj") == with_early


def test_the_o_gemvs_early_release_is_on_by_default_and_off_by_its_variable(monkeypatch):
    """On by default since its GPU tests passed (session 27); ``TOKENLOOM_O_EARLY_RELEASE=0``
    turns it off; outside ``next_reads_weights_first`` no GEMV releases early."""
    from tokenloom.plugins.models import pdl

    monkeypatch.delenv("TOKENLOOM_O_EARLY_RELEASE", raising=False)
    assert not pdl.early_release()
    with pdl.next_reads_weights_first():
        assert pdl.early_release()
    assert not pdl.early_release()
    monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "0")
    with pdl.next_reads_weights_first():
        assert not pdl.early_release()


def test_every_pdl_kernel_releases_only_after_its_wait():
    """The contract the decode attention's prefetch relies on (``pdl.py``): a kernel
    that calls ``release(USE_PDL)`` calls ``wait(USE_PDL)`` on an earlier line, and none
    returns before its wait (an exited program counts as released), so that when a
    kernel starts, every kernel but the one before it has finished. The exceptions
    (``release_early``, before the wait): the RMSNorm kernel and act-order's gather (the
    successor of each is a projection, which reads only weights before its wait) and the
    one-row GEMVs under
    ``pdl.next_reads_weights_first`` (set around the o projection alone, whose successor
    is the add+norm). A kernel after those (the norm, the gate/up GEMV) may start while
    two or three kernels before it still run; each reads only weights before its wait."""
    import ast
    from pathlib import Path

    import tokenloom
    import tokenloom.contrib
    import tokenloom.plugins

    roots = {Path(m.__file__).parent for m in (tokenloom, tokenloom.plugins, tokenloom.contrib)}
    files = sorted({path.resolve() for root in roots for path in root.rglob("*.py")})
    checked = 0
    early: list[str] = []
    for path in files:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            lines: dict[str, list[int]] = {"wait": [], "release": [], "release_early": []}
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in lines
                    and [getattr(a, "id", None) for a in node.args] == ["USE_PDL"]
                ):
                    lines[node.func.id].append(node.lineno)
            if lines["release_early"]:  # only the norm, whose successor reads only weights
                early.append(fn.name)
                assert lines["wait"], f"{path.name}:{fn.name}"
            if lines["release"]:
                checked += 1
                assert lines["wait"], f"{path.name}:{fn.name} releases without a wait"
                assert min(lines["release"]) > min(lines["wait"]), f"{path.name}:{fn.name}"
            if lines["wait"]:  # a program that exits counts as released: none before its wait
                returns = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Return)]
                assert all(r > min(lines["wait"]) for r in returns), f"{path.name}:{fn.name}"
    assert checked >= 15  # the decode path's kernels (15 in session 20)
    # the norm (a projection follows), and the one-row GEMVs when the o projection
    # runs them (pdl.next_reads_weights_first: the norm follows; only llama.py sets it)
    # and act-order's gather (a projection follows it too)
    assert sorted(early) == [
        "_add_rms_norm_kernel", "_gather_columns_kernel", "_gemv_kernel",
        "_int4_gemv_nk_kernel", "_int8_gemv_nk_kernel",
    ]  # fmt: skip
    # ... and the flag is set around the o projection alone (its successor: the add+norm)
    uses = [(path.name, line) for path in files
            for line in path.read_text().splitlines()
            if "next_reads_weights_first(" in line and "def " not in line]  # fmt: skip
    assert len(uses) == 1 and uses[0][0] == "llama.py", uses
    source = next(p for p in files if p.name == "llama.py").read_text()
    after = source.split("next_reads_weights_first(", 1)[1].splitlines()[1]
    assert after.strip().startswith("return self.o_proj("), after
