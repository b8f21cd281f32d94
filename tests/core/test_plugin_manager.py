"""The plugin manager: built-ins, components by name, broken plugins, hooks."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tokenloom.config import EngineConfig, load_config
from tokenloom.plugin_manager import PluginError, PluginManager
from tokenloom.plugins import BUILTIN_PLUGINS
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class FakeScheduler:
    def __init__(self, config: Any, kv_cache: Any) -> None:
        self.config = config
        self.kv_cache = kv_cache


def provider(*specs: ComponentSpec) -> Any:
    class Plugin:
        @hookimpl
        def tokenloom_register_components(self) -> list[ComponentSpec]:
            return list(specs)

    return Plugin()


class RaisingRegistration:
    @hookimpl
    def tokenloom_register_components(self) -> list[ComponentSpec]:
        raise RuntimeError("registration exploded")


def test_every_builtin_plugin_registers_like_an_external_one() -> None:
    pm = PluginManager.default()
    assert [b.name for b in pm.broken] == []
    origins = {c.origin for c in pm.components()}
    assert origins <= set(BUILTIN_PLUGINS)
    assert pm.component("quant", "none") is not None
    quant = {(c.kind, c.name): c for c in pm.components()}[("quant", "none")]
    assert quant.origin == "tokenloom.plugins.quant.none"


def test_build_uses_the_factory_of_the_named_component() -> None:
    pm = PluginManager()
    pm.register(provider(ComponentSpec("scheduler", "fake", FakeScheduler, "a fake")), "fakes")
    built = pm.build("scheduler", "fake", "config", kv_cache="kv")
    assert isinstance(built, FakeScheduler) and built.kv_cache == "kv"
    row = pm.components()[0]
    assert (row.kind, row.name, row.origin, row.description) == (
        "scheduler",
        "fake",
        "fakes",
        "a fake",
    )


def test_unknown_component_lists_the_available_names_of_its_kind() -> None:
    pm = PluginManager()
    pm.register(
        provider(
            ComponentSpec("scheduler", "alpha", FakeScheduler),
            ComponentSpec("scheduler", "beta", FakeScheduler),
            ComponentSpec("quant", "gamma", object),
        ),
        "fakes",
    )
    with pytest.raises(PluginError) as err:
        pm.component("scheduler", "nope")
    message = str(err.value)
    assert "'nope'" in message and "alpha, beta" in message and "gamma" not in message


def test_the_same_component_from_two_plugins_is_an_error_naming_both() -> None:
    pm = PluginManager()
    pm.register(provider(ComponentSpec("scheduler", "dup", FakeScheduler)), "first")
    pm.register(provider(ComponentSpec("scheduler", "dup", FakeScheduler)), "second")
    with pytest.raises(PluginError) as err:
        pm.components()
    assert "first" in str(err.value) and "second" in str(err.value)


def test_a_raising_registration_hook_marks_only_that_plugin_broken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pm = PluginManager()
    pm.register(provider(ComponentSpec("scheduler", "ok", FakeScheduler)), "good")
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        pm.register(RaisingRegistration(), "exploding")
        assert [c.name for c in pm.components()] == ["ok"]
    assert [b.name for b in pm.broken] == ["exploding"]
    assert "exploding" in caplog.text
    with pytest.raises(PluginError) as err:
        pm.component("scheduler", "missing")
    assert "exploding" in str(err.value) and "registration exploded" in str(err.value)


def test_an_unimportable_module_is_recorded_broken_with_its_traceback() -> None:
    pm = PluginManager()
    pm.load_modules(["tokenloom.plugins.quant.none", "tokenloom.no_such_plugin_module"])
    assert pm.component("quant", "none").name == "none"
    (broken,) = pm.broken
    assert broken.name == "tokenloom.no_such_plugin_module"
    assert "ModuleNotFoundError" in broken.traceback


def test_configure_hook_sees_the_config_and_can_refuse_it() -> None:
    seen: list[Any] = []

    class Watcher:
        @hookimpl
        def tokenloom_configure(self, config: Any) -> None:
            seen.append(config)

    class Refuser:
        @hookimpl
        def tokenloom_configure(self, config: Any) -> None:
            if config.max_num_seqs > 8:
                raise ValueError("max_num_seqs: at most 8 with this plugin")

    pm = PluginManager()
    pm.register(Watcher(), "watcher")
    pm.register(Refuser(), "refuser")
    small = EngineConfig(max_num_seqs=4)
    pm.configure(small)
    assert seen == [small]
    with pytest.raises(PluginError) as err:
        pm.configure(EngineConfig(max_num_seqs=16))
    assert "refuser" in str(err.value) and "at most 8" in str(err.value)


def test_observation_hooks_reach_every_plugin_that_implements_them() -> None:
    calls: list[tuple[str, Any]] = []

    class Observer:
        @hookimpl
        def tokenloom_request_added(self, request_id: str, num_prompt_tokens: int) -> None:
            calls.append(("added", (request_id, num_prompt_tokens)))

        @hookimpl
        def tokenloom_request_finished(
            self, request_id: str, finish_reason: str, num_output_tokens: int
        ) -> None:
            calls.append(("finished", (request_id, finish_reason, num_output_tokens)))

        @hookimpl
        def tokenloom_components_built(self, components: dict[str, Any]) -> None:
            calls.append(("built", sorted(components)))

        @hookimpl
        def tokenloom_shutdown(self, process: str) -> None:
            calls.append(("shutdown", process))

    pm = PluginManager()
    pm.register(Observer(), "observer")
    pm.register(Observer(), "second-observer")
    pm.hook.tokenloom_components_built(components={"scheduler": 1, "executor": 2})
    pm.hook.tokenloom_request_added(request_id="r", num_prompt_tokens=3)
    pm.hook.tokenloom_request_finished(
        request_id="r", finish_reason="stop", num_output_tokens=2, metrics=None
    )
    pm.hook.tokenloom_shutdown(process="frontend")
    assert calls[::2] == calls[1::2]  # both observers saw each call
    assert calls[::2] == [
        ("built", ["executor", "scheduler"]),
        ("added", ("r", 3)),
        ("finished", ("r", "stop", 2)),
        ("shutdown", "frontend"),
    ]


def test_config_file_swapping_the_scheduler_builds_the_swapped_one(tmp_path: Any) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('[components]\nscheduler = "fake-swap"\n')
    pm = PluginManager()
    pm.register(provider(ComponentSpec("scheduler", "fake-swap", FakeScheduler)), "swap")
    config = load_config(config_file)
    scheduler = pm.build("scheduler", config.scheduler, config, SimpleNamespace())
    assert isinstance(scheduler, FakeScheduler) and scheduler.config is config


def test_config_file_swapping_to_contrib_static_runs_the_static_scheduler(tmp_path: Any) -> None:
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.sampling import SamplingParams

    config_file = tmp_path / "engine.toml"
    config_file.write_text(
        'scheduler = "static"\nblock_size = 4\nnum_blocks = 16\nmax_model_len = 64\n'
    )
    config = load_config(config_file)
    pm = PluginManager()
    pm.load_modules(["tokenloom.plugins.kv_cache.paged", "tokenloom.contrib.schedulers.static"])
    assert pm.broken == []
    kv = pm.build("kv_cache", config.kv_cache, config, config.num_blocks, config.block_size)
    scheduler = pm.build("scheduler", config.scheduler, config, kv)
    assert type(scheduler).__module__ == "tokenloom.contrib.schedulers.static"
    scheduler.add_request(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=2)))
    step = scheduler.schedule()
    assert [chunk.request_id for chunk in step.chunks] == ["r"]
