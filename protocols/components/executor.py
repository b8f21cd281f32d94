"""The executor interface: runs the scheduler's steps on the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.protocols.components.model import ModelInfo
    from tokenloom.protocols.step import StepInput, StepOutput


class PendingStep(ABC):
    """A step an executor has launched; ``result`` waits for its output."""

    @abstractmethod
    def result(self) -> StepOutput:
        """Block until the step is done; call once."""


class DoneStep(PendingStep):
    """A step that is already done (executors without pipelining)."""

    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


class Executor(ABC):
    """Runs steps on the model. Constructed as ``factory(config: EngineConfig,
    plugins: tokenloom.plugin_manager.PluginManager)``; the executor builds the
    attention backend, quant method, proposer and model named in the config with
    ``plugins.build(kind, name, *args)`` (each kind's constructor contract is on its
    interface; a model is found by its Hugging Face architecture name).

    Lives in the engine-core process (rank 0). ``execute`` may sync the host only to
    read the sampled token ids.
    """

    # Pipelining: ``submit`` launches a step and returns without waiting for it. An
    # executor that sets this lets the engine build and submit step N+1 while step N
    # runs (async scheduling): it must accept ``PLACEHOLDER_TOKEN`` inputs (see
    # ``protocols.step``) and run submitted steps in order.
    supports_pipelining: bool = False
    # Start-up reports for ``tokenloom bench`` (read after ``init_kv_cache``): device
    # memory by use in GiB (weights_gib, kv_gib, ...) and seconds of start-up work by
    # phase (graph_capture_s, ...). Empty when the executor measures nothing.
    memory: Mapping[str, float] = MappingProxyType({})
    timings: Mapping[str, float] = MappingProxyType({})

    @abstractmethod
    def load_model(self) -> ModelInfo:
        """Load weights onto the device; returns the model's shape and limits."""

    @abstractmethod
    def num_kv_blocks(self, block_size: int) -> int:
        """How many KV blocks fit in the memory budget (profiles a forward pass on GPU)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV cache (and capture CUDA graphs where enabled)."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step: forward pass over the flat batch, then sampling."""

    def submit(self, step: StepInput) -> PendingStep:
        """Launch one step; the default runs it to completion."""
        return DoneStep(self.execute(step))

    def shutdown(self) -> None:  # noqa: B027
        """Release devices and worker processes."""
