"""Model plugin: the Llama-family decoder for every architecture it covers.

Registers one component of kind ``model`` per Hugging Face architecture name. The
contract a model fulfils (its factory's arguments, ``forward``, ``compute_logits``,
the loader's ``checkpoint_slots``) is ``protocols.components.model.Model``.

torch is imported only when a model is built, so processes that merely register
plugins (frontend, CLI) stay light.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

ModelFactory = Callable[[dict[str, Any], Any], Any]


def build_llama_family(hf_config: dict[str, Any], dtype: Any) -> Any:
    """Build a ``LlamaForCausalLM`` (its switches come from the config)."""
    from tokenloom.plugins.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(hf_config, dtype)


MODEL_FACTORIES: dict[str, ModelFactory] = {
    "LlamaForCausalLM": build_llama_family,
    "MistralForCausalLM": build_llama_family,
    "Qwen2ForCausalLM": build_llama_family,
    "Qwen3ForCausalLM": build_llama_family,
}

_DESCRIPTIONS = {
    "LlamaForCausalLM": "Llama 2 / 3 / 3.1 (rope scaling: linear, llama3)",
    "MistralForCausalLM": "Mistral (no sliding window)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (q/k/v bias)",
    "Qwen3ForCausalLM": "Qwen3 (per-head q/k RMSNorm)",
}


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec("model", arch, factory, _DESCRIPTIONS[arch])
        for arch, factory in MODEL_FACTORIES.items()
    ]
