"""The quantization interface: weight and KV-cache formats."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class QuantMethod(ABC):
    """Weight and KV-cache quantization. Constructed as ``factory(config: EngineConfig)``.

    Applied by the executor once, after the weights are loaded, in every process
    that holds a model shard.
    """

    name: str

    @abstractmethod
    def quantize_model(self, model: torch.nn.Module) -> None:
        """Replace or convert the model's linear weights in place."""

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV cache; the model's own by default."""
        return model_dtype
