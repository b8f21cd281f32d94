"""Frontend plugin ``openai``: an OpenAI-compatible HTTP server (starlette + uvicorn)."""

from __future__ import annotations

from typing import Any

from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


def _build(*args: Any, **kwargs: Any) -> Any:
    # imported on use: starlette and uvicorn stay out of processes that only list plugins
    from tokenloom.plugins.frontends.openai.frontend import OpenAIFrontend

    return OpenAIFrontend(*args, **kwargs)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "frontend", "openai", _build, "OpenAI-compatible HTTP server (completions, chat)"
        )
    ]
