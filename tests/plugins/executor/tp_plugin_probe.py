"""A plugin module for the tensor-parallel tests: the quant method ``tp-probe`` (int8
under another name). An engine configured with it starts only where this module is
registered, so TP=2 with it shows that the caller's plugin reached the worker processes."""

from __future__ import annotations

from tokenloom.plugins.quant.int8 import Int8Quant
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class ProbeQuant(Int8Quant):
    name = "tp-probe"


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [ComponentSpec("quant", "tp-probe", ProbeQuant, "int8, for the TP plugin test")]
