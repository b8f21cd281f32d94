"""The registry record: how a plugin offers one implementation of one component kind.

A component kind is chosen by name in the config (``scheduler = "continuous"``). A
plugin provides implementations through the ``tokenloom_register_components`` hook
as ``ComponentSpec`` entries; the plugin manager builds them by kind and name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = (
    "scheduler",
    "kv_cache",
    "attention",
    "quant",
    "executor",
    "proposer",
    "frontend",
    "model",
)


@dataclass(frozen=True)
class ComponentSpec:
    """One implementation of one component kind.

    ``factory`` builds the component; its signature is the kind's constructor
    contract, stated on the kind's interface (e.g. a scheduler factory takes
    ``(config, kv_cache)``). For kind ``model`` the name is the Hugging Face
    architecture (``LlamaForCausalLM``).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    description: str = ""
