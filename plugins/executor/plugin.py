"""Executor plugin ``model``: the model runner on one device (``model_runner.py``), or,
with ``tensor_parallel_size`` > 1, rank 0 of a tensor-parallel group of them
(``parallel/executor.py``). The choice lives here, above both, so that the one-device
runner does not know of the group built from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.config import EngineConfig
from tokenloom.plugins.executor.model_runner import ModelRunner
from tokenloom.plugins.executor.settings import ModelExecutorSettings
from tokenloom.protocols.components.executor import Executor
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

if TYPE_CHECKING:
    from tokenloom.plugin_manager import PluginManager


def make_executor(config: EngineConfig, plugins: PluginManager) -> Executor:
    """The ``model`` executor: the runner on one device, or, with
    ``tensor_parallel_size`` > 1, rank 0 of a tensor-parallel group of them."""
    if config.tensor_parallel_size > 1:  # imported here: the one-device start-up never loads it
        from tokenloom.plugins.executor.parallel.executor import TensorParallelExecutor

        return TensorParallelExecutor(config, plugins)
    return ModelRunner(config, plugins)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "executor",
            "model",
            make_executor,
            "model runner, CUDA graphs, tensor parallel",
            settings=ModelExecutorSettings,
        )
    ]
