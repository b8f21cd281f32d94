"""Quant plugin ``none``: weights and KV cache stay in the model's dtype."""

from __future__ import annotations

from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.quant import QuantMethod
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class NoQuant(QuantMethod):
    name = "none"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def quantize_model(self, model: Any) -> None:
        return None


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [ComponentSpec("quant", "none", NoQuant, "no quantization")]
