"""The KV cache manager interface: which physical blocks each request holds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class KVCacheManager(ABC):
    """Owns the block pool: which physical blocks each request holds.

    Constructed as ``factory(config: EngineConfig, num_blocks: int, block_size: int)``.
    Pure bookkeeping on the CPU: it never touches tensors. Block ids index the
    executor's KV tensors. Calls come from the scheduler only, in the engine-core
    process.
    """

    block_size: int
    num_blocks: int
    # Prefix-cache counters for /metrics, reported by the scheduler's ``stats``:
    # prompt tokens looked up by successful ``allocate`` calls, and how many of them
    # were served from the cache. A manager without a prefix cache leaves both at 0.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and unused)."""

    @abstractmethod
    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are in the prefix cache (whole
        blocks only). Does not change any state. It is what ``allocate`` would reuse
        right now, so it may stop short of the cache (e.g. to leave the last token to
        compute): a scheduler sizes a request's first chunk with it."""

    @abstractmethod
    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int | None:
        """Give a request that holds no blocks enough blocks for its first ``num_tokens``
        tokens, reusing cached prefix blocks. Returns the number of leading tokens already
        computed (from the cache; always less than ``len(token_ids)``), or None when the
        pool cannot cover it (then nothing changed)."""

    @abstractmethod
    def append(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens`` tokens in total. Returns
        False, changing nothing, when the pool cannot cover it."""

    @abstractmethod
    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first ``num_computed`` tokens (``token_ids[:num_computed]``)
        are in the KV cache, so that their full blocks can be shared by prefix."""

    @abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; ``[]`` for a request that holds no blocks. The
        returned list may be the live one: callers must not mutate it."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block the request holds. Idempotent."""
