"""``tokenloom eval``: the subcommand records, evaluates, prints the table and writes JSON."""

from __future__ import annotations

import json

from tokenloom.entrypoints.cli import main
from tokenloom.eval.report import REPORT_KEYS

PROMPTS = {
    "max_tokens": 4,
    "prompts": [
        {"id": "a", "kind": "completion", "prompt": "Once upon a time"},
        {"id": "b", "kind": "chat", "messages": [{"role": "user", "content": "Hi"}]},
    ],
}


def test_eval_cli_records_then_writes_the_documented_json(tiny_model_factory, tmp_path, capsys):
    model_dir = str(tiny_model_factory("llama"))
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    (tmp_path / "text.txt").write_text("A short text about rivers.\n\nAnd one about bread.\n")
    common = [
        model_dir,
        "--golden",
        str(tmp_path / "golden.json"),
        "--text",
        str(tmp_path / "text.txt"),
        "--dtype",
        "float32",
        "--attention",
        "torch",
        "--threads",
        "0",  # keep this test process's torch threads as they are
    ]
    args = ["--record", "--prompts", str(tmp_path / "prompts.json")]
    assert main(["eval", *common, *args]) == 0
    assert (tmp_path / "golden.json").exists()
    capsys.readouterr()

    out = tmp_path / "report.json"
    assert main(["eval", *common, "--max-num-batched-tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("time (s):")
    assert printed[0].startswith("this run:") and "kv_cache_dtype=auto" in printed[0]
    assert any(line.startswith("token agreement") and "100.0%" in line for line in printed)

    report = json.loads(out.read_text())
    assert tuple(report) == REPORT_KEYS
    assert report["config"]["dtype"] == "float32"
    assert report["config"]["max_num_batched_tokens"] == 8
    assert report["reference"]["config"]["max_num_batched_tokens"] == 8192
    assert report["exact_match_pct"] == 100.0 and report["num_prompts"] == 2
    assert report["perplexity_delta"] is not None and abs(report["perplexity_delta"]) < 1e-3
    lo, hi = report["perplexity_delta_pct_95"]  # paired with the recording's passages
    assert lo <= report["perplexity_delta_pct"] <= hi and abs(lo) < 0.1 and abs(hi) < 0.1
    golden = json.loads((tmp_path / "golden.json").read_text())
    assert len(golden["passage_nlls"]) == len(golden["passage_tokens"]) == 2
    assert sum(golden["passage_tokens"]) == report["num_text_tokens"]
    assert set(report["timings"]) == {
        "load_s",
        "perplexity_s",
        "golden_s",
        "total_s",
        "threads",
    }


def test_eval_cli_refuses_an_unrecorded_golden_file(tiny_model_factory, tmp_path, capsys):
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    code = main(
        [
            "eval",
            str(tiny_model_factory("llama")),
            "--golden",
            str(tmp_path / "prompts.json"),
            "--threads",
            "0",
        ]
    )
    assert code == 2
    assert "--record" in capsys.readouterr().err
