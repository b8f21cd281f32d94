"""Frontend plugin ``zmq``: the job protocol (``protocols/jobs.py``) on a ROUTER socket."""

from __future__ import annotations

from typing import Any

from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


def _build(*args: Any, **kwargs: Any) -> Any:
    from tokenloom.plugins.frontends.zmq.frontend import ZmqFrontend

    return ZmqFrontend(*args, **kwargs)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [ComponentSpec("frontend", "zmq", _build, "ZeroMQ job protocol (ROUTER socket)")]
