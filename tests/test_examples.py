"""The offline examples run end to end (the server examples need a running server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_custom_scheduler_example_beats_the_default_on_its_workload():
    out = _run("custom_scheduler.py")
    steps = dict(re.findall(r"(\w+): a request finishes after ([\d.]+)", out))
    assert set(steps) == {"continuous", "spf"}
    assert float(steps["spf"]) < float(steps["continuous"])


def test_offline_generate_example_prints_completions_and_chat():
    out = _run("offline_generate.py")
    assert "0.0:" in out and "1.1:" in out
    assert "finish=length" in out
    assert out.count("chat:") == 1
