"""The plugin manager: loads plugins, collects their components, builds them by name.

Built-in plugins (``tokenloom.plugins.BUILTIN_PLUGINS``) and third-party ones (the
entry-point group ``tokenloom``) are registered the same way: each is a module or
object with ``@hookimpl`` functions, and provides components through
``tokenloom_register_components``. Environment:

- ``TOKENLOOM_PLUGINS=a,b``: only these entry points autoload (by entry-point name).
- ``TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD=1``: no entry point autoloads (built-ins still do).

A plugin that fails to import, or whose registration hook raises, is recorded as
broken and logged; it fails start-up only when the config asks for a component it
might have provided (``component`` then raises with its traceback).
"""

from __future__ import annotations

import importlib
import os
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from tokenloom.logging import get_logger
from tokenloom.protocols import hookspecs
from tokenloom.protocols.components.registry import KINDS, ComponentSpec

log = get_logger(__name__)

ENTRY_POINT_GROUP = "tokenloom"
# Config fields that name one component of the kind of the same name.
CONFIG_KINDS = ("scheduler", "kv_cache", "attention", "quant", "executor", "proposer")
ALLOW_ENV = "TOKENLOOM_PLUGINS"
DISABLE_ENV = "TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD"


class PluginError(RuntimeError):
    """A component cannot be provided: unknown name, broken plugin, or a conflict."""


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    traceback: str


@dataclass(frozen=True)
class RegisteredComponent:
    """A row of ``tokenloom plugins``: the spec and the plugin that provided it."""

    kind: str
    name: str
    origin: str  # module name of a built-in, distribution name of a third-party plugin
    description: str
    spec: ComponentSpec


class PluginManager:
    """Holds the registered plugins and the components they provide.

    ``PluginManager.default()`` loads the built-ins and autoloads entry points; a bare
    ``PluginManager()`` holds nothing until ``register``/``load_*`` are called.
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._origins: dict[str, str] = {}  # plugin name -> origin shown to users
        self._broken: dict[str, BrokenPlugin] = {}
        self._components: dict[tuple[str, str], RegisteredComponent] | None = None

    @classmethod
    def default(cls) -> PluginManager:
        """Built-in plugins, then the autoloaded entry points."""
        from tokenloom.plugins import BUILTIN_PLUGINS

        pm = cls()
        pm.load_modules(BUILTIN_PLUGINS)
        pm.load_entry_points()
        return pm

    @property
    def hook(self) -> Any:
        """The hook caller (``pm.hook.tokenloom_request_added(...)``)."""
        return self._pm.hook

    @property
    def broken(self) -> list[BrokenPlugin]:
        self._collect()
        return list(self._broken.values())

    # ------------------------------------------------------------------ loading

    def register(self, plugin: Any, name: str, origin: str | None = None) -> None:
        """Register a plugin object or module under ``name`` (shown as ``origin``)."""
        self._pm.register(plugin, name=name)
        self._origins[name] = origin or name
        self._components = None

    def registered(self) -> dict[str, Any]:
        """Every registered plugin (module or object) by name, in registration order."""
        return dict(self._pm.list_name_plugin())

    def load_modules(self, module_names: tuple[str, ...] | list[str]) -> None:
        """Import and register modules by name (origin = module name)."""
        for module_name in module_names:
            try:
                module = importlib.import_module(module_name)
            except Exception:
                self._mark_broken(module_name, traceback.format_exc())
                continue
            self.register(module, module_name)

    def load_entry_points(self) -> None:
        """Autoload the ``tokenloom`` entry points, honouring the environment switches."""
        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            log.info("plugin autoload disabled by %s", DISABLE_ENV)
            return
        allowed = _allow_list()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            if self._pm.has_plugin(ep.name) or ep.name in self._broken:
                continue
            origin = ep.dist.name if ep.dist is not None else ep.name
            try:
                plugin = ep.load()
            except Exception:
                self._mark_broken(ep.name, traceback.format_exc())
                continue
            self.register(plugin, ep.name, origin)

    def _mark_broken(self, name: str, tb: str) -> None:
        last_line = tb.strip().splitlines()[-1]
        log.warning("plugin %s is broken and was skipped: %s", name, last_line)
        log.debug("traceback of plugin %s:\n%s", name, tb)
        self._broken[name] = BrokenPlugin(name, tb)

    # ------------------------------------------------------------------ components

    def components(self) -> list[RegisteredComponent]:
        """Every registered component, sorted by kind then name."""
        return sorted(self._collect().values(), key=lambda c: (c.kind, c.name))

    def component(self, kind: str, name: str) -> ComponentSpec:
        """The spec of component ``kind``/``name``. Raises PluginError that lists the
        available names of that kind and the tracebacks of broken plugins."""
        found = self._collect().get((kind, name))
        if found is not None:
            return found.spec
        available = sorted(n for k, n in self._collect() if k == kind)
        lines = [
            f"no {kind} named {name!r}; available: {', '.join(available) or '(none)'}",
        ]
        if kind not in KINDS:
            lines.append(f"(known kinds: {', '.join(KINDS)})")
        for broken in self._broken.values():
            lines.append(f"plugin {broken.name} failed to load and may provide it:")
            lines.append(broken.traceback.rstrip())
        raise PluginError("\n".join(lines))

    def build(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Build component ``kind``/``name`` with its factory's arguments. A component
        that builds others (its class declares ``plugins = None``: ``QuantMethod``,
        ``Proposer``) gets this manager there, so what it builds comes from the engine's
        plugins, not from ``PluginManager.default()``."""
        component = self.component(kind, name).factory(*args, **kwargs)
        if "plugins" in dir(type(component)) and getattr(component, "plugins", 0) is None:
            component.plugins = self
        return component

    def check_config(self, config: Any) -> None:
        """Validate, before anything heavy is built, what the config asks of plugins:
        every component it names exists (scheduler, kv_cache, attention unless
        "auto", quant, executor, proposer, each frontend), and every ``[plugin.NAME]``
        table fits the settings Struct that component NAME declares
        (``ComponentSpec.settings``). Raises PluginError (unknown or broken
        component, listing the available ones) or ConfigError (``plugin.NAME.KEY``,
        or ``[plugin.NAME]`` for a table that names no registered component or
        plugin: its settings would be silently unused, so a misspelt NAME fails too)."""
        from tokenloom.config import ConfigError, plugin_settings

        wanted = [(kind, getattr(config, kind)) for kind in CONFIG_KINDS]
        wanted += [("frontend", name) for name in config.frontends]
        for kind, name in wanted:
            if not (kind == "attention" and name == "auto"):
                self.component(kind, name)
        components = self._collect().values()
        for name in config.plugin:
            specs = [c.spec for c in components if c.name == name]
            if not specs and not self._pm.has_plugin(name):
                known = {c.name for c in components}
                known |= {n for n, _ in self._pm.list_name_plugin() if "." not in n}
                raise ConfigError(
                    f"[plugin.{name}]: no registered component or plugin is named {name!r}; "
                    f"known: {', '.join(sorted(known))}"
                )
            for spec in specs:
                if spec.settings is not None:
                    plugin_settings(config, name, spec.settings)

    def configure(self, config: Any) -> None:
        """Call ``tokenloom_configure`` on every plugin; a ValueError from one becomes
        a PluginError that names the plugin."""
        for impl in self._pm.hook.tokenloom_configure.get_hookimpls():
            try:
                impl.function(config=config)
            except ValueError as exc:
                raise PluginError(f"plugin {impl.plugin_name} refused the config: {exc}") from exc

    def _collect(self) -> dict[tuple[str, str], RegisteredComponent]:
        if self._components is not None:
            return self._components
        found: dict[tuple[str, str], RegisteredComponent] = {}
        # Call each plugin's hook separately, so a raising one is skipped alone and
        # every spec is attributed to the plugin that returned it.
        for impl in reversed(self._pm.hook.tokenloom_register_components.get_hookimpls()):
            plugin = impl.plugin_name
            try:
                result: Any = impl.function()
                specs = list(result or [])
                for spec in specs:
                    if not isinstance(spec, ComponentSpec):
                        raise TypeError(f"expected ComponentSpec, got {type(spec).__name__}")
            except Exception:
                self._pm.unregister(name=plugin)
                self._mark_broken(plugin, traceback.format_exc())
                continue
            origin = self._origins.get(plugin, plugin)
            for spec in specs:
                key = (spec.kind, spec.name)
                if key in found:
                    raise PluginError(
                        f"{spec.kind} {spec.name!r} is registered twice: by "
                        f"{found[key].origin} and by {origin}"
                    )
                found[key] = RegisteredComponent(
                    spec.kind, spec.name, origin, spec.description, spec
                )
        self._components = found
        return found


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}
