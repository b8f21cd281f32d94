"""Programmatic dependent launch (``plugins/models/pdl.py``): off on the CPU and when
turned off; on an H200, a chain of the decode path's PDL kernels (norm, int4 GEMVs
with their in-kernel split sums, one releasing before its wait as the o projection's
does, SiLU, fp8 quantization and GEMV, the bf16 skinny
GEMM and one-row GEMV) replayed in a CUDA graph gives, replay after replay with new inputs, the
bits of the same kernels launched without PDL: a kernel that read or wrote before its
wait would race with the one before it and differ."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.models import pdl


def test_pdl_is_off_on_the_cpu_and_when_turned_off(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl_on(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"USE_PDL": False}


def _chain(x, res, norm_w, gate_up, down, w8, ws8, w16):
    from tokenloom.plugins.models.fused_ops import add_rms_norm, silu_and_mul
    from tokenloom.plugins.models.skinny_gemm import gemv, skinny_gemm
    from tokenloom.plugins.quant.kernels.fp8_gemv import fp8_gemv
    from tokenloom.plugins.quant.kernels.fp8_quant import per_token_fp8

    h, summed = add_rms_norm(x, norm_w, 1e-6, res)
    a = silu_and_mul(gate_up.apply(h, None))
    with pdl.next_reads_weights_first():  # the GEMV releases before its wait: the norm next
        y = down.apply(a, None)
    h2, _ = add_rms_norm(y, norm_w, 1e-6, summed)
    q, s = per_token_fp8(h2)
    z = fp8_gemv(q, s, w8, ws8, None, torch.bfloat16)
    return gemv(skinny_gemm(z, w16, (32, 256, 4, 4)), w16.t().contiguous(), (8, 512, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_chain_in_a_graph_gives_the_bits_of_the_plain_launches(monkeypatch):
    from tokenloom.plugins.quant.int4 import Int4Kernel, quantize_int4

    if not pdl.pdl_on(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 (and TOKENLOOM_PDL not 0)")
    torch.manual_seed(0)
    dev, dim, inter = "cuda", 4096, 4096
    norm_w = torch.rand(dim, device=dev, dtype=torch.bfloat16) + 0.5
    gate_up = Int4Kernel(*quantize_int4(torch.randn(2 * inter, dim, device=dev).bfloat16()), 128)
    down = Int4Kernel(*quantize_int4(torch.randn(dim, inter, device=dev).bfloat16() / 8), 128)
    w8 = (torch.randn(1024, dim, device=dev) * 64).to(torch.float8_e4m3fn)
    ws8 = torch.rand(1024, 1, device=dev) / 1000
    w16 = torch.randn(512, 1024, device=dev).bfloat16() / 32
    weights = (norm_w, gate_up, down, w8, ws8, w16)
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


def test_every_pdl_kernel_releases_only_after_its_wait():
    """The contract the decode attention's prefetch relies on (``pdl.py``): a kernel
    that calls ``release(USE_PDL)`` calls ``wait(USE_PDL)`` on an earlier line, and none
    returns before its wait (an exited program counts as released), so that when a
    kernel starts, every kernel but the one before it has finished. The exception
    (``release_early``, before the wait) is the RMSNorm kernel's alone: its successor is
    a projection, which reads only weights before its wait."""
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
    # runs them (pdl.next_reads_weights_first: the norm follows)
    assert sorted(early) == ["_add_rms_norm_kernel", "_gemv_kernel", "_int4_gemv_nk_kernel"]
