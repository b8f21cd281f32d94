"""``/openapi.json``: the server's OpenAPI 3.1 document, generated from the request
Structs in ``schemas`` (``msgspec.json.schema_components``), so it cannot drift from
what the server decodes. Responses are described by status only; the fuzz tests use
the request schemas to generate bodies.
"""

from __future__ import annotations

from typing import Any

import msgspec

import tokenloom
from tokenloom.plugins.frontends.openai.schemas import ChatCompletionRequest, CompletionRequest

_ERRORS = {
    "400": {"description": "Invalid request; the error names the field"},
    "401": {"description": "Missing or invalid API key"},
    "404": {"description": "Model not served here"},
    "413": {"description": "Body larger than max_request_body_mb"},
    "415": {"description": "Content-Type is not application/json"},
    "503": {"description": "Queue full or engine down; see Retry-After"},
}


def openapi_document() -> dict[str, Any]:
    (completion, chat), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template="#/components/schemas/{name}"
    )

    def generation(schema: dict[str, Any], summary: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                "responses": {"200": {"description": "The completion (JSON or SSE)"}, **_ERRORS},
            }
        }

    def info(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenloom", "version": tokenloom.__version__},
        "paths": {
            "/v1/completions": generation(completion, "Text completion"),
            "/v1/chat/completions": generation(chat, "Chat completion"),
            "/v1/models": info("The served model"),
            "/health": info("200 while the engine serves, else 503"),
            "/version": info("Server version"),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
