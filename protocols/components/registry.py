"""The registry record: how a plugin offers one implementation of one component kind.

A component kind is chosen by name in the config (``scheduler = "continuous"``). A
plugin provides implementations through the ``tokenloom_register_components`` hook
as ``ComponentSpec`` entries; the plugin manager builds them by kind and name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

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
    ``(config, kv_cache, clock=...)``). For kind ``model`` the name is the Hugging
    Face architecture (``LlamaForCausalLM``).

    ``settings`` declares the component's ``[plugin.NAME]`` table (NAME = ``name``)
    as a msgspec Struct with defaults; declare it with ``forbid_unknown_fields=True``
    so a mistyped key fails. The plugin manager validates the table against it
    before anything heavy is built (``PluginManager.check_config``): a bad key or
    value fails start-up with ``plugin.NAME.KEY`` in the message. The component
    reads its settings with ``tokenloom.config.plugin_settings(config, NAME,
    settings)``. None: the component takes no declared settings (its table, if any,
    is not checked key by key).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    description: str = ""
    settings: type[msgspec.Struct] | None = None
