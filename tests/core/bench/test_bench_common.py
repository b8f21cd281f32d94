"""The benches' engine flags reach the engine config."""

from __future__ import annotations

import argparse

from tokenloom.bench.common import add_engine_args, engine_options
from tokenloom.config import EngineConfig


def _options(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_options(parser.parse_args(["--model", "/some/dir", *argv]))


def test_quant_lm_head_is_the_method_s_default_unless_asked_and_reaches_the_config():
    assert _options("--quant", "int8")["quant_lm_head"] is None  # the method's default
    assert _options("--quant", "int8", "--no-quant-lm-head")["quant_lm_head"] is False
    options = _options("--quant", "int8", "--quant-lm-head", "--kv-cache-dtype", "fp8")
    assert options["quant_lm_head"] is True and options["kv_cache_dtype"] == "fp8"
    config = EngineConfig(**options)  # every option is an EngineConfig field
    assert config.quant_lm_head and config.quant == "int8"
