"""``python -m tokenloom.bench.host``: a tiny run times every component of real
decode steps and is reproducible (the same seed gives the same tokens)."""

from __future__ import annotations

import json

from tokenloom.bench import host


def test_tiny_run_times_each_component_and_repeats_its_tokens(tmp_path, capsys) -> None:
    out = tmp_path / "host.json"
    argv = ["--num-running", "3", "--context", "40", "--steps", "4", "--warmup", "2"]
    assert host.main([*argv, "--runs", "2", "--output-json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["num_running"] == 3 and result["steps"] == 4
    medians = result["median_us"]
    for name in ("scheduler", "input_prep", "result_folding", "loop_output", "frontend"):
        assert medians[name] > 0, name
    parts = sum(medians[name] for name in host.HOST_ENGINE)
    assert medians["engine_host_total"] <= medians["step_total"]
    assert 0.5 * parts <= medians["engine_host_total"] <= 2 * parts
    assert len(result["tokens_digests"]) == 1  # both runs produced the same tokens
    assert "engine_host_total" in capsys.readouterr().out


def test_churn_times_the_steps_a_new_prompt_joins(tmp_path, capsys) -> None:
    out = tmp_path / "host.json"
    argv = ["--num-running", "3", "--context", "40", "--steps", "6", "--warmup", "1"]
    assert host.main([*argv, "--churn", "2", "--output-json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["num_mixed_steps"] == 3  # one new prompt every other step
    mixed = result["mixed_median_us"]
    assert mixed["loop_input"] > 0 and mixed["kv_manager"] > 0
    assert "steps with a prefill chunk only" in capsys.readouterr().out
