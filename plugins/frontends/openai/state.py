"""What the routes (``app.py``, ``info.py``) read of the server they run in: the
engine, the tokenizer, the limits, the metrics and the admission count.
``OpenAIFrontend`` owns them and hands itself to ``OpenAIApp``; naming this protocol,
rather than the frontend's class, keeps the routes below the frontend that builds them."""

from __future__ import annotations

from typing import Any, Protocol

from tokenloom.config import EngineConfig
from tokenloom.plugins.frontends.admission import Admission
from tokenloom.plugins.frontends.generation import LiveGenerations
from tokenloom.plugins.frontends.limits import ModelLimits
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.protocols.components.engine import EngineClient


class ServerState(Protocol):
    @property
    def config(self) -> EngineConfig: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def model_name(self) -> str: ...
    @property
    def limits(self) -> ModelLimits: ...
    @property
    def metrics(self) -> ServingMetrics: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def live(self) -> LiveGenerations: ...
