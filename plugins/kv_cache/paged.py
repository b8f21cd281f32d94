"""KV cache plugin ``paged``: a pool of fixed-size blocks with hash-chained prefix sharing.

Pure bookkeeping on the CPU. A request holds a block table (a list of block ids);
block ``i`` holds the KV of token positions ``i * block_size .. (i + 1) * block_size - 1``.

Prefix sharing: once ``commit`` says a FULL block's tokens are computed, the block is
registered under the key ``(parent_key_id, tokens_of_the_block)``, where
``parent_key_id`` is a number given to the previous block's key when that key was
registered (0 for the first block). Keys are compared exactly by the dict (the
tokens are part of the key), and key ids are never reused, so a hash collision can
never make two different prefixes share a block. Blocks are reference counted; a
block whose count drops to zero stays in the cache (and counts as free) until the
pool needs a fresh block, which takes the least recently freed one (uncached blocks
first). A referenced block is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

BlockKey = tuple[int, tuple[int, ...]]  # (parent key id, the block's token ids)

ROOT_KEY_ID = 0


class _BlockTable:
    """One request's blocks and how far its prefix chain is registered."""

    __slots__ = ("blocks", "num_hashed", "parent_key_id")

    def __init__(self, blocks: list[int], num_hashed: int, parent_key_id: int) -> None:
        self.blocks = blocks
        self.num_hashed = num_hashed  # leading blocks whose key is resolved
        self.parent_key_id = parent_key_id  # key id of block num_hashed - 1


class PagedKVCache(KVCacheManager):
    """Block pool with per-request block tables and LRU-evicted prefix caching."""

    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._key_ids = [ROOT_KEY_ID] * num_blocks
        self._next_key_id = ROOT_KEY_ID + 1
        self._cache: dict[BlockKey, int] = {}  # key -> block id
        # Blocks with no reference, least recently freed first; values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, _BlockTable] = {}
        self.prefix_cache_queries = 0  # tokens looked up by successful allocations
        self.prefix_cache_hits = 0  # of which served from the cache

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cache)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._keys[block_id] is not None

    def request_ids(self) -> list[str]:
        """Requests that hold blocks now."""
        return list(self._tables)

    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Usable cached prefix: whole blocks, and always fewer than ``len(token_ids)``
        tokens, so that the last token is computed (its logits are needed)."""
        return len(self._match(token_ids)) * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return table.blocks if table is not None else []

    # ----------------------------------------------------------------- mutation

    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int | None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self._match(token_ids)
        num_cached = len(hits) * self.block_size
        bs = self.block_size
        num_fresh = (max(num_tokens, num_cached) + bs - 1) // bs - len(hits)
        refs = self._ref_counts
        num_revived = sum(1 for block in hits if refs[block] == 0)
        if num_fresh > len(self._free) - num_revived:
            return None
        for block in hits:
            if refs[block] == 0:
                del self._free[block]
            refs[block] += 1
        # The chain continues from the last HIT's key (read before the fresh blocks go
        # on the end of the same list: reading it after gave a fresh block's stale key
        # id, so the next block was registered as if it began a prompt).
        parent = self._key_ids[hits[-1]] if hits else ROOT_KEY_ID
        blocks = hits
        for _ in range(num_fresh):
            blocks.append(self._take_fresh_block())
        self._tables[request_id] = _BlockTable(blocks, num_cached // bs, parent)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_cached
        return num_cached

    def append(self, request_id: str, num_tokens: int) -> bool:
        blocks = self._tables[request_id].blocks
        missing = (num_tokens + self.block_size - 1) // self.block_size - len(blocks)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        for _ in range(missing):
            blocks.append(self._take_fresh_block())
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        table = self._tables.get(request_id)
        if table is None or not self.enable_prefix_caching:
            return
        num_full = num_computed // self.block_size
        if num_full <= table.num_hashed:
            return
        bs = self.block_size
        parent = table.parent_key_id
        for index in range(table.num_hashed, num_full):
            key = (parent, tuple(token_ids[index * bs : (index + 1) * bs]))
            holder = self._cache.get(key)
            if holder is None:
                block = table.blocks[index]
                holder = block
                self._cache[key] = block
                self._keys[block] = key
                self._key_ids[block] = self._next_key_id
                self._next_key_id += 1
            # When another block already holds this content ours stays private, and the
            # chain continues under the holder's key id so that later blocks match.
            parent = self._key_ids[holder]
        table.num_hashed = num_full
        table.parent_key_id = parent

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        refs = self._ref_counts
        free = self._free
        # Tail blocks first, so that a prefix's later blocks are evicted before its root.
        for block in reversed(table.blocks):
            refs[block] -= 1
            if refs[block] == 0:
                free[block] = None
                if self._keys[block] is None:
                    free.move_to_end(block, last=False)  # uncached: reuse before cached ones

    # ----------------------------------------------------------------- internals

    def _match(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks of the longest usable prefix of ``token_ids``."""
        hits: list[int] = []
        if not self.enable_prefix_caching or not self._cache:
            return hits
        bs = self.block_size
        parent = ROOT_KEY_ID
        cache = self._cache
        for index in range((len(token_ids) - 1) // bs):
            block = cache.get((parent, tuple(token_ids[index * bs : (index + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = self._key_ids[block]
        return hits

    def _take_fresh_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._keys[block]
        if key is not None:  # evict: its content is about to be overwritten
            del self._cache[key]
            self._keys[block] = None
        self._ref_counts[block] = 1
        return block


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "kv_cache", "paged", PagedKVCache, "paged blocks with hash-chained prefix sharing"
        )
    ]
