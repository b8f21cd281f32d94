"""``tokenloom serve`` start-up errors are printed once: a config mistake before any
engine-core starts (no traceback), an engine-core failure as its one traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", *args, "--port", "0"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_unknown_scheduler_is_reported_once_without_a_traceback(tiny_model_factory: Any) -> None:
    done = _serve(str(tiny_model_factory("llama")), "--scheduler", "nope")
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert output.count("no scheduler named 'nope'; available: ") == 1
    assert "Traceback" not in output


def test_engine_core_failure_prints_its_traceback_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    done = _serve(str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert output.count("engine = build(config, pm)") == 1, output[-3000:]  # one traceback
    assert "its traceback is above" in output
