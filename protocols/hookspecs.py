"""pluggy hook specifications of tokenloom, grouped by lifecycle.

A plugin is any module or object with functions marked ``@hookimpl``; built-in
plugins are registered exactly like third-party ones, which come from the
entry-point group ``tokenloom``. Hooks wire components at start-up and observe
requests; nothing calls a hook per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from tokenloom.protocols.components.registry import ComponentSpec
    from tokenloom.protocols.outputs import RequestMetrics

PROJECT = "tokenloom"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- start-up and registration


@hookspec
def tokenloom_register_components() -> list[ComponentSpec]:
    """Return the components this plugin provides.

    Called by the plugin manager once per process, right after plugins are loaded,
    in every process that builds components (engine-core, frontend, CLI).

    :return: a list of ``ComponentSpec`` (kind, name, factory, description). Two
        plugins registering the same (kind, name) is a start-up error naming both.
    """


@hookspec
def tokenloom_configure(config: Any) -> None:
    """Inspect the validated config before any component is built.

    Called once per process after the config is loaded and validated, in the
    engine-core and frontend processes. Raise ``ValueError`` to refuse the config:
    start-up fails with the plugin's name and the message.

    :param config: the ``EngineConfig``; plugin settings are in ``config.plugin``.
    """


# --------------------------------------------------------------------------- component construction


@hookspec
def tokenloom_components_built(components: dict[str, Any]) -> None:
    """See the components the engine-core built, before it serves.

    Called once in the engine-core process after the scheduler, KV cache manager
    and executor exist and the KV cache is allocated. Observe-only: the engine has
    already wired the components together, so replacing or reconfiguring one here
    has no defined effect; keep references to read them (counters, stats) later.

    :param components: kind -> component instance (``scheduler``, ``kv_cache``,
        ``executor``).
    """


# --------------------------------------------------------------------------- per-request observation


@hookspec
def tokenloom_request_added(request_id: str, num_prompt_tokens: int) -> None:
    """A request entered the engine.

    Called in the engine-core process when the kernel accepts a request (not for
    requests refused because the queue is full). Must be cheap and must not block.
    """


@hookspec
def tokenloom_request_first_token(
    request_id: str, num_prompt_tokens: int, num_cached_tokens: int
) -> None:
    """A request's first output token(s) came back from the executor.

    Called in the engine-core process once per request (before its
    ``tokenloom_request_finished``), in the engine step that folded the token in;
    read the time from your own clock (the engine's is ``time.monotonic`` unless it
    was given another). Not called for a request that finished without a token
    (aborted or timed out while waiting). Must be cheap and must not block.

    :param num_cached_tokens: prompt tokens served from the prefix cache.
    """


@hookspec
def tokenloom_request_finished(
    request_id: str,
    finish_reason: str,
    num_output_tokens: int,
    metrics: RequestMetrics | None,
) -> None:
    """A request finished (stopped, hit its length, aborted, timed out or failed).

    Called in the engine-core process once per request, after its last delta is
    queued for sending. Must be cheap and must not block. An implementation may
    take any subset of the parameters (pluggy passes only those it names).

    :param metrics: the request's timings and counters (``RequestMetrics``: arrival,
        first scheduled, first token, finish on the engine clock; preemptions;
        cached prompt tokens); None from a scheduler that does not report them.
    """


# --------------------------------------------------------------------------- shutdown


@hookspec
def tokenloom_shutdown(process: str) -> None:
    """The process is shutting down.

    Called once per process during clean shutdown (``process`` is "engine-core" or
    "frontend"), after serving stopped and before components are released.
    """
