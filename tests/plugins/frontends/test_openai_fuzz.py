"""Fuzzing the HTTP API from its own ``/openapi.json`` with schemathesis: bodies valid
(positive) and invalid (negative) against the request schemas, sent through ASGI to a
frontend over an in-process engine; no response may be a 5xx.

schemathesis's pytest integration (``from_fixture``/``parametrize``) fails to collect
under this pytest, so its strategies are drawn with hypothesis directly. Bounded:
``MAX_EXAMPLES`` per operation and mode, about 20 s on two CPU cores."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from serving_fakes import asgi_frontend

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 100
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
              "GET /health", "GET /version"]  # fmt: skip
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def api_schema(tiny_model_factory):
    frontend = asgi_frontend(tiny_model_factory("llama"), max_num_seqs=64)
    return schemathesis.openapi.from_asgi("/openapi.json", frontend.app.starlette)


def test_every_route_is_in_the_schema(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


CASES = [(label, mode) for label in OPERATIONS for mode in MODES[: 2 if "POST" in label else 1]]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=lambda x: getattr(x, "value", x))
def test_no_generated_request_gets_a_5xx(api_schema, label, mode):
    operation = next(
        result.ok() for result in api_schema.get_all_operations() if result.ok().label == label
    )
    statuses: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES if label.startswith("POST") else 10,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text)

    fuzz()
    print(f"{label} {mode.value}: {dict(sorted(statuses.items()))}")
    assert statuses
