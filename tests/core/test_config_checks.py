"""The config is checked before anything heavy: component names, ``[plugin.NAME]``
settings declared as msgspec Structs, and a CUDA device that is not there."""

from __future__ import annotations

import msgspec
import pytest

from tokenloom.config import (
    ConfigError,
    load_config,
    plugin_settings,
    speculation_configured,
    speculative_tokens,
)
from tokenloom.engine.engine_core import Engine, resolve_config
from tokenloom.plugin_manager import PluginError, PluginManager
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.sampling import SamplingParams


class AgingSettings(msgspec.Struct, forbid_unknown_fields=True):
    aging_tokens_per_s: float = 100.0
    max_boost: int = 4096


class AgingPlugin:
    @hookimpl
    def tokenloom_register_components(self) -> list[ComponentSpec]:
        return [ComponentSpec("scheduler", "aging", ContinuousScheduler, settings=AgingSettings)]


def _pm() -> PluginManager:
    pm = PluginManager.default()
    pm.register(AgingPlugin(), "aging-plugin")
    return pm


def test_declared_settings_are_read_with_defaults() -> None:
    config = load_config(scheduler="aging", plugin={"aging": {"max_boost": 7}})
    _pm().check_config(config)
    assert plugin_settings(config, "aging", AgingSettings) == AgingSettings(100.0, 7)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"aging_token_per_s": 5}, r"plugin\.aging\.aging_token_per_s: unknown setting; known: "),
        ({"max_boost": "lots"}, r"plugin\.aging\.max_boost: Expected `int`, got `str`"),
    ],
)
def test_bad_settings_fail_naming_the_key(table: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _pm().check_config(load_config(scheduler="aging", plugin={"aging": table}))


def test_unknown_component_fails_before_the_model_is_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The model directory does not exist: loading it would fail differently.
    config = load_config(model=str(tmp_path / "missing"), scheduler="agign")
    with pytest.raises(PluginError, match="no scheduler named 'agign'; available: .*aging"):
        Engine.from_config(config, _pm())


def test_bad_settings_fail_before_the_model_is_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = load_config(model=str(tmp_path / "missing"), plugin={"aging": {"oops": 1}})
    with pytest.raises(ConfigError, match=r"plugin\.aging\.oops"):
        Engine.from_config(config, _pm())


def test_unknown_frontend_fails_the_check() -> None:
    with pytest.raises(PluginError, match="no frontend named 'grpc'"):
        _pm().check_config(load_config(frontends=["openai", "grpc"]))


def test_table_naming_nothing_fails_listing_the_known_names() -> None:
    message = r"\[plugin\.agin\]: no registered component or plugin is named 'agin'; known: .*aging"
    with pytest.raises(ConfigError, match=message):
        _pm().check_config(load_config(plugin={"agin": {"x": 1}}))


def test_cuda_without_a_gpu_is_a_clear_config_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match='device: "cuda" was asked for, but torch sees no CUDA'):
        resolve_config(load_config(model="x", device="cuda"))


@pytest.mark.parametrize(
    ("name", "table"),
    [
        ("triton", {"decode_blok_n": 32}),  # attention
        ("ngram", {"max_m": 3}),  # proposer
        ("draft", {"cuda_graph": False}),  # proposer
        ("replay", {"acceptence": 0.5}),  # proposer (contrib)
        ("int4", {"group_siz": 64}),  # quant
        ("model", {"symm_mem_allreduce": True}),  # executor
    ],
)
def test_builtin_settings_typos_fail_before_the_model_is_read(tmp_path, name, table) -> None:  # type: ignore[no-untyped-def]
    key = next(iter(table))
    config = load_config(model=str(tmp_path / "missing"), plugin={name: table})
    with pytest.raises(ConfigError, match=rf"plugin\.{name}\.{key}: unknown setting; known: "):
        Engine.from_config(config, PluginManager.default())


def test_builtin_settings_bad_values_fail_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"plugin\.int4: group_size must be a positive multiple of 8"
    ):
        _pm().check_config(load_config(plugin={"int4": {"group_size": 12}}))
    with pytest.raises(ConfigError, match=r"plugin\.draft\.cuda_graphs: Expected `bool`"):
        _pm().check_config(load_config(plugin={"draft": {"cuda_graphs": "maybe"}}))


def test_kv_cache_dtype_takes_vllm_s_fp8_e4m3_and_refuses_e5m2() -> None:
    from tokenloom.config import EngineConfig

    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    assert load_config(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of auto, fp8, int8"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_block_size_defaults_to_64_for_an_fp8_cache_else_16(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sizes = {
        kv: load_config(kv_cache_dtype=kv).block_size for kv in ("auto", "fp8", "fp8_e4m3", "int8")
    }
    assert sizes == {"auto": 16, "fp8": 64, "fp8_e4m3": 64, "int8": 16}
    # a pool of blocks given keeps the 16 tokens a block it was sized in
    assert load_config(kv_cache_dtype="fp8", num_blocks=100).block_size == 16
    # a size given is kept, from the flags or a file; a negative one still fails
    assert load_config(kv_cache_dtype="fp8", block_size=16).block_size == 16
    path = tmp_path / "engine.toml"
    path.write_text('kv_cache_dtype = "fp8"\nblock_size = 32\n')
    assert load_config(path).block_size == 32
    with pytest.raises(ConfigError, match="block_size"):
        load_config(block_size=-16)


def test_a_request_s_drafts_are_its_own_capped_by_the_engine_s_and_none_without_a_proposer():
    # the engine core and the executor both ask the config (neither asks the other)
    spec = load_config(None, proposer="ngram", num_speculative_tokens=4)
    assert speculation_configured(spec)
    assert speculative_tokens(spec, SamplingParams()) == 4  # the engine's by default
    assert speculative_tokens(spec, SamplingParams(num_speculative_tokens=2)) == 2
    assert speculative_tokens(spec, SamplingParams(num_speculative_tokens=9)) == 4
    assert speculative_tokens(spec, SamplingParams(num_speculative_tokens=0)) == 0
    for plain in (load_config(None, num_speculative_tokens=4), load_config(None, proposer="ngram")):
        assert not speculation_configured(plain)
        assert speculative_tokens(plain, SamplingParams(num_speculative_tokens=3)) == 0
