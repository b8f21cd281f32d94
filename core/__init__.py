"""tokenloom: an LLM inference and serving engine.

``from tokenloom import LLM, SamplingParams`` is the offline API. Heavy modules
(torch) load lazily, so ``import tokenloom`` and ``tokenloom --help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.protocols.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tokenloom.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenloom.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")
