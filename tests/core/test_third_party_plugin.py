"""A third-party plugin, installed from a distribution built in the test, is
discovered through its entry point, listed, selectable, and obeys the switches."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenloom.config import load_config
from tokenloom.plugin_manager import PluginError, PluginManager

FIFO_MODULE = """
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class FifoTestScheduler:
    def __init__(self, config, kv_cache):
        self.config = config


@hookimpl
def tokenloom_register_components():
    return [ComponentSpec("scheduler", "fifo-test", FifoTestScheduler, "first in, first out")]
"""

BROKEN_MODULE = 'raise ImportError("broken_test plugin cannot import its kernels")\n'


def write_distribution(root: Path, dist: str, module: str, entry: str, source: str) -> Path:
    src = root / dist
    src.mkdir()
    (src / "pyproject.toml").write_text(
        f"""[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"

[project.entry-points.tokenloom]
{entry} = "{module}"

[tool.setuptools]
py-modules = ["{module}"]
"""
    )
    (src / f"{module}.py").write_text(source)
    return src


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("dists")
    fifo = write_distribution(
        root, "tokenloom-fifo-test", "tokenloom_fifo_test", "fifo_test", FIFO_MODULE
    )
    broken = write_distribution(
        root, "tokenloom-broken-test", "tokenloom_broken_test", "broken_test", BROKEN_MODULE
    )
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target), str(fifo), str(broken)],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    for name in ("tokenloom_fifo_test", "tokenloom_broken_test"):
        sys.modules.pop(name, None)


@pytest.fixture
def autoload_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("TOKENLOOM_PLUGINS", raising=False)
    monkeypatch.delenv("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return monkeypatch


def autoloaded() -> PluginManager:
    pm = PluginManager()
    pm.load_entry_points()
    return pm


def test_entry_point_plugin_is_discovered_with_its_distribution_as_origin(
    site_dir: Path, autoload_env: pytest.MonkeyPatch
) -> None:
    rows = {(c.kind, c.name): c for c in autoloaded().components()}
    fifo = rows[("scheduler", "fifo-test")]
    assert fifo.origin.replace("_", "-") == "tokenloom-fifo-test"
    assert fifo.description == "first in, first out"


def test_entry_point_plugin_is_selectable_by_config(
    site_dir: Path, autoload_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('scheduler = "fifo-test"\n')
    config = load_config(config_file)
    scheduler = autoloaded().build("scheduler", config.scheduler, config, None)
    assert type(scheduler).__name__ == "FifoTestScheduler" and scheduler.config is config


def test_entry_point_plugin_is_listed_by_the_plugins_command(site_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), *sys.path])}
    env.pop("TOKENLOOM_PLUGINS", None)
    env.pop("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run(
        [sys.executable, "-m", "tokenloom", "plugins"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )  # fmt: skip
    line = next(line for line in out.stdout.splitlines() if "fifo-test" in line)
    assert line.split()[:3] == ["scheduler", "fifo-test", line.split()[2]]
    assert "fifo" in line.split()[2] and "first in, first out" in line
    assert "broken_test" in out.stderr  # the unused broken plugin is logged, not fatal


def test_unused_broken_plugin_is_logged_and_skipped(
    site_dir: Path, autoload_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        pm = autoloaded()
    assert [b.name for b in pm.broken] == ["broken_test"]
    assert "broken_test" in caplog.text
    assert pm.component("scheduler", "fifo-test").name == "fifo-test"


def test_broken_plugin_named_in_config_fails_with_its_name_and_traceback(
    site_dir: Path, autoload_env: pytest.MonkeyPatch
) -> None:
    pm = autoloaded()
    with pytest.raises(PluginError) as err:
        pm.component("scheduler", "from-the-broken-plugin")
    message = str(err.value)
    assert "broken_test" in message
    assert "Traceback" in message and "cannot import its kernels" in message
    assert "fifo-test" in message  # and what is available instead


def test_allow_list_autoloads_only_the_named_entry_points(
    site_dir: Path, autoload_env: pytest.MonkeyPatch
) -> None:
    autoload_env.setenv("TOKENLOOM_PLUGINS", "fifo_test")
    pm = autoloaded()
    assert pm.broken == []
    assert pm.component("scheduler", "fifo-test").name == "fifo-test"
    autoload_env.setenv("TOKENLOOM_PLUGINS", "broken_test")
    pm = autoloaded()
    assert [b.name for b in pm.broken] == ["broken_test"]
    with pytest.raises(PluginError):
        pm.component("scheduler", "fifo-test")


def test_kill_switch_stops_autoload_but_keeps_builtins(
    site_dir: Path, autoload_env: pytest.MonkeyPatch
) -> None:
    autoload_env.setenv("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = PluginManager()
    pm.load_modules(["tokenloom.plugins.quant.none"])
    pm.load_entry_points()
    assert pm.broken == []
    assert [(c.kind, c.name) for c in pm.components()] == [("quant", "none")]
