"""A trace against a live server: ``bench serve --trace`` sends each request at its
arrival time with its lengths, priority and tenant, and ``serve --record-trace``
logs what the server saw, in the format the simulator reads back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "plugins" / "frontends"))
from serving_fakes import ServerThread  # noqa: E402

from tokenloom.bench.serve import main  # noqa: E402
from tokenloom.config import make_config  # noqa: E402
from tokenloom.sim.workload import TraceRequest, load_trace, write_jsonl  # noqa: E402


def test_trace_replay_honours_arrivals_and_the_server_records_it(tiny_model_factory, tmp_path):
    trace = [
        TraceRequest(0.0, 12, 5, priority=1, tenant="a"),
        TraceRequest(0.3, 30, 3, tenant="b"),
        TraceRequest(0.3, 8, 7, tenant="a"),
        TraceRequest(0.9, 20, 4, priority=2),
        TraceRequest(1.2, 16, 6, tenant="b"),
    ]
    write_jsonl(trace, tmp_path / "in.jsonl")
    recorded = tmp_path / "recorded.jsonl"
    config = make_config({
        "model": str(tiny_model_factory("llama")), "port": 0, "max_model_len": 256,
        "record_trace": str(recorded),
    })  # fmt: skip
    server = ServerThread(config, engine_factory=None).start()
    out = tmp_path / "replay.json"
    try:
        code = main([
            "--base-url", server.base_url, "--trace", str(tmp_path / "in.jsonl"),
            "--token-range", "20:200", "--slo-ttft-ms", "60000", "--out", str(out),
        ])  # fmt: skip
    finally:
        assert server.stop() == 0
    assert code == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 5 and report["failed"] == 0
    sent = sorted(report["requests"], key=lambda r: r["sent_at"])
    for want, got in zip(trace, sent, strict=True):
        assert abs(got["sent_at"] - want.arrival_s) < 0.15
        assert (got["prompt_len"], got["output_len"]) == (want.prompt_len, want.output_len)
    assert all(r["ttft"] > 0 and r["engine_metrics"]["num_preemptions"] == 0 for r in sent)
    summary = report["trace_summary"]
    assert summary["completed"] == 5 and summary["slo_attainment"] == 1.0
    assert summary["queue_ms"]["p50"] >= 0
    assert summary["ttft_ms"]["p50"] > 0 and set(summary["by_tenant"]) == {"", "a", "b"}

    lines = [json.loads(line) for line in recorded.read_text().splitlines()]
    assert len(lines) == 5
    assert all(line["finish_reason"] == "length" and line["ttft_s"] > 0 for line in lines)
    assert "prompt_token_ids" not in lines[0] and "text" not in lines[0]
    back = load_trace(recorded)
    # (Tenants are recorded from GenerateRequest.tenant; the OpenAI frontend does not
    # pass ``user`` through to it yet, so they are not compared here.)
    assert sorted((r.prompt_len, r.output_len, r.priority) for r in back) == sorted(
        (r.prompt_len, r.output_len, r.priority) for r in trace
    )
    assert back[0].arrival_s == 0.0
    assert abs(back[-1].arrival_s - 1.2) < 0.3  # the server's clock saw the same spacing


def test_trace_recorder_logs_lengths_classes_and_finish_without_tokens(tmp_path):
    from tokenloom.engine.trace_recorder import TraceRecorder
    from tokenloom.protocols.outputs import TokenDelta
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.sampling import SamplingParams

    class Engine:
        def __init__(self):
            self.live = []

        def add_request(self, request):
            if len(request.prompt_token_ids) > 100:
                raise ValueError("too long")
            self.live.append(request.request_id)

        def step(self):
            deltas = [TokenDelta(rid, [3, 4]) for rid in self.live]
            deltas[0].finish_reason = "stop"
            self.live.pop(0)
            return deltas

        def abort(self, ids):
            return [TokenDelta(rid, [], "abort") for rid in ids if rid in self.live]

    now = [100.0]
    recorder = TraceRecorder(Engine(), str(tmp_path / "t.jsonl"), clock=lambda: now[0])
    params = SamplingParams()
    recorder.add_request(GenerateRequest("x", [9] * 7, params, priority=2, tenant="acme"))
    now[0] = 100.5
    recorder.add_request(GenerateRequest("y", [9] * 3, params))
    with pytest.raises(ValueError):  # refused: not recorded
        recorder.add_request(GenerateRequest("z", [9] * 101, params))
    recorder.step()  # x: 2 tokens, stops
    recorder.step()  # y: 4 tokens in all, stops
    recorder._file.flush()
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [(r["prompt_len"], r["output_len"], r["finish_reason"]) for r in lines] == [
        (7, 2, "stop"),
        (3, 4, "stop"),
    ]
    assert lines[0]["priority"] == 2 and lines[0]["tenant"] == "acme"
    assert abs(lines[1]["arrival_s"] - lines[0]["arrival_s"] - 0.5) < 1e-3
    back = load_trace(tmp_path / "t.jsonl")
    assert [(r.arrival_s, r.tenant) for r in back] == [(0.0, "acme"), (back[1].arrival_s, "")]


def test_the_worked_example_serves_on_a_real_server_and_records_its_trace(
    tiny_model_factory, tmp_path, monkeypatch
):
    # Installed as a third-party package would be: an entry point in group "tokenloom".
    info = tmp_path / "ep" / "spf_aging_example-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spf-aging-example\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[tokenloom]\nspf-aging = spf_aging\n")
    monkeypatch.syspath_prepend(str(tmp_path / "ep"))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "examples" / "schedulers"))

    trace = [TraceRequest(0.0, 40, 4), TraceRequest(0.0, 10, 4), TraceRequest(0.1, 25, 3)]
    write_jsonl(trace, tmp_path / "in.jsonl")
    recorded = tmp_path / "recorded.jsonl"
    config = make_config({
        "model": str(tiny_model_factory("llama")), "port": 0, "max_model_len": 256,
        "scheduler": "spf-aging", "record_trace": str(recorded),
    })  # fmt: skip
    server = ServerThread(config, engine_factory=None).start()
    try:
        code = main([
            "--base-url", server.base_url, "--trace", str(tmp_path / "in.jsonl"),
            "--token-range", "20:200", "--out", str(tmp_path / "r.json"),
        ])  # fmt: skip
    finally:
        assert server.stop() == 0
    assert code == 0
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 3
    assert len(recorded.read_text().splitlines()) == 3
