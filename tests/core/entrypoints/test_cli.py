"""The tokenloom command: fast help, generated config flags, lazy dispatch."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from tokenloom.config import EngineConfig
from tokenloom.entrypoints.cli import build_parser, main


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, result: int = 0) -> list[Any]:
    calls: list[Any] = []
    module = types.ModuleType(name)
    module.main = lambda arg: calls.append(arg) or result  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_help_answers_fast_without_importing_torch() -> None:
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from tokenloom.entrypoints.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(time.perf_counter() - t, 'torch' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, torch_loaded, numpy_loaded = out.stdout.split()[-3:]
    assert (torch_loaded, numpy_loaded) == ("False", "False")
    assert float(seconds) < 0.8  # measured ~0.1 s; slack for a loaded machine


def test_python_dash_m_tokenloom_prints_the_commands() -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "tokenloom", "--help"], capture_output=True, text=True, check=True
    )
    assert time.perf_counter() - start < 5.0
    for command in ("plugins", "serve", "bench", "tiny-model"):
        assert command in out.stdout


def test_serve_has_one_flag_per_config_field() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    dests = {action.dest for action in serve._actions}
    assert set(EngineConfig.__struct_fields__) - {"plugin"} <= dests
    assert "plugin" not in dests


def test_serve_builds_the_config_from_file_then_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = fake_module(monkeypatch, "tokenloom.entrypoints.serve")
    config_file = tmp_path / "engine.toml"
    config_file.write_text('scheduler = "static"\nmax_num_seqs = 4\nport = 9000\n')
    rc = main(
        ["serve", "/models/tiny", "--config", str(config_file), "--max-num-seqs", "8",
         "--no-enable-prefix-caching", "--frontends", "openai,zmq", "--kv-cache-memory-gb", "0.5"]
    )  # fmt: skip
    assert rc == 0
    (config,) = calls
    assert config.model == "/models/tiny"
    assert (config.scheduler, config.port) == ("static", 9000)  # from the file
    assert config.max_num_seqs == 8  # the flag wins over the file
    assert config.enable_prefix_caching is False
    assert config.frontends == ["openai", "zmq"]
    assert config.kv_cache_memory_gb == 0.5


def test_invalid_config_prints_the_field_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_module(monkeypatch, "tokenloom.entrypoints.serve")
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: max_num_seqs")
    assert calls == []


@pytest.mark.parametrize("bench", ["scheduler", "throughput", "latency", "serve"])
def test_bench_dispatches_its_arguments_to_the_bench_module(
    monkeypatch: pytest.MonkeyPatch, bench: str
) -> None:
    calls = fake_module(monkeypatch, f"tokenloom.bench.{bench}", result=3)
    assert main(["bench", bench, "--num-requests", "5", "--json", "out.json"]) == 3
    assert calls == [["--num-requests", "5", "--json", "out.json"]]


def test_tiny_model_dispatches_to_tiny_models(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_module(monkeypatch, "tokenloom.checkpoints.tiny_models")
    assert main(["tiny-model", "llama", "--out", "/tmp/x"]) == 0
    assert calls == [["llama", "--out", "/tmp/x"]]


def test_plugins_lists_kind_name_and_origin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["KIND", "NAME", "ORIGIN", "DESCRIPTION"]
    rows = [line.split()[:3] for line in lines[1:]]
    assert ["quant", "none", "tokenloom.plugins.quant.none"] in rows
