"""``tokenloom bench serve`` against a live server: every request completes and the
report holds the latency percentiles and throughputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "plugins" / "frontends"))
from serving_fakes import ServerThread  # noqa: E402

from tokenloom.bench.serve import RequestResult, main, sample_lengths, summarize  # noqa: E402
from tokenloom.config import make_config  # noqa: E402


def test_bench_serve_reports_latency_and_throughput(tiny_model_factory, tmp_path, capsys):
    config = make_config(
        {"model": str(tiny_model_factory("llama")), "port": 0, "max_model_len": 256}
    )
    server = ServerThread(config).start()
    out = tmp_path / "serve.json"
    try:
        code = main([
            "--base-url", server.base_url, "--num-prompts", "12", "--max-concurrency", "4",
            "--input-len", "20", "--output-len", "10", "--range-ratio", "0.5",
            "--token-range", "20:200", "--out", str(out),
        ])  # fmt: skip
    finally:
        assert server.stop() == 0
    assert code == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0
    assert 12 * 5 <= report["output_tokens"] <= 12 * 15
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert report["request_throughput"] > 0 and report["output_token_throughput"] > 0
    assert "ttft_ms mean/p50/p90/p99" in capsys.readouterr().out


def test_lengths_stay_in_range_and_summary_derives_tpot_and_throughput():
    import random

    lengths = sample_lengths(100, 0.2, 500, random.Random(0))
    assert min(lengths) >= 80 and max(lengths) <= 120 and len(set(lengths)) > 10
    results = [RequestResult(True, 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4)] * 4
    summary = summarize(results, duration=2.0)
    assert summary["request_throughput"] == 2.0
    assert abs(summary["tpot_ms"]["mean"] - 100.0) < 1e-6


def test_a_request_that_showed_no_token_is_left_out_of_the_latencies():
    # Random weights can stream only empty texts: no first token was seen, so its
    # TTFT is unknown; counting it as 0 pulled the p50 to 0 ms on a CPU run.
    shown = RequestResult(True, 10, 5, ttft=0.2, e2e=0.6, itl=[0.1] * 4)
    blank = RequestResult(True, 10, 5, ttft=0.0, e2e=0.9)
    summary = summarize([shown, blank, blank], duration=1.0)
    assert summary["no_visible_token"] == 2
    assert summary["ttft_ms"]["p50"] == summary["ttft_ms"]["mean"] == 200.0
    assert abs(summary["tpot_ms"]["mean"] - 100.0) < 1e-6
    assert summary["output_tokens"] == 15  # throughput still counts every token
