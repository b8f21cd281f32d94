"""examples/plugin_package installs as a third-party package: its entry point is
found, its policy is short and uses no private member, its own conformance test
passes, and ``tokenloom bench scheduler --scheduler srpf`` runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "examples" / "plugin_package"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    target = tmp_path_factory.mktemp("srpf-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target), str(PACKAGE)],
        check=True, timeout=300,
    )  # fmt: skip
    yield target


def _env(site_dir: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), *sys.path])}
    env.pop("TOKENLOOM_PLUGINS", None)
    env.pop("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def test_the_policy_is_short_and_uses_only_public_members() -> None:
    source = (PACKAGE / "tokenloom_srpf.py").read_text()
    assert len(source.splitlines()) < 60
    assert not re.findall(r"\._[a-zA-Z]", source), "reaches a private member"


def test_installed_package_is_listed_and_passes_its_conformance_test(site_dir: Path) -> None:
    env = _env(site_dir)
    listed = subprocess.run(
        [sys.executable, "-m", "tokenloom", "plugins"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )  # fmt: skip
    assert any(line.split()[:2] == ["scheduler", "srpf"] for line in listed.stdout.splitlines())
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
        capture_output=True, text=True, env=env, timeout=600, cwd=site_dir,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert re.search(r"\b8 passed\b", tests.stdout), tests.stdout[-500:]


def test_bench_scheduler_runs_the_third_party_scheduler(site_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--scheduler", "srpf", "--num-running", "16", "--num-waiting", "40"]
    argv += ["--prompt-len", "40", "--steps", "40", "--warmup", "5", "--out", str(out)]
    subprocess.run(
        [sys.executable, "-m", "tokenloom", "bench", "scheduler", *argv],
        capture_output=True, text=True, env=_env(site_dir), check=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert (result["scheduler"], result["num_running"], result["num_waiting"]) == ("srpf", 16, 40)
