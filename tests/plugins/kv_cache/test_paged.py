"""The paged KV manager: block accounting, prefix sharing, LRU eviction."""

from __future__ import annotations

import pytest

from tokenloom.config import EngineConfig
from tokenloom.plugins.kv_cache.paged import PagedKVCache, tokenloom_register_components

BS = 4


def make(num_blocks: int = 8, caching: bool = True) -> PagedKVCache:
    return PagedKVCache(EngineConfig(enable_prefix_caching=caching), num_blocks, BS)


def test_registers_as_kv_cache_paged() -> None:
    (spec,) = tokenloom_register_components()
    assert (spec.kind, spec.name, spec.factory) == ("kv_cache", "paged", PagedKVCache)


def test_allocate_covers_requested_tokens_and_free_returns_blocks() -> None:
    kv = make(8)
    assert kv.allocate("a", list(range(10)), 10) == 0
    assert len(kv.block_ids("a")) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 5
    kv.free("a")
    kv.free("a")  # idempotent
    assert kv.num_free_blocks == 8
    assert kv.block_ids("a") == []


def test_allocate_refuses_without_changing_anything_when_pool_is_short() -> None:
    kv = make(4)
    assert kv.allocate("a", list(range(12)), 12) == 0
    assert kv.allocate("b", list(range(8)), 8) is None
    assert kv.num_free_blocks == 1
    assert kv.request_ids() == ["a"]


def test_append_grows_table_only_when_a_block_fills() -> None:
    kv = make(3)
    kv.allocate("a", [1, 2, 3], 3)
    assert kv.append("a", 4) and len(kv.block_ids("a")) == 1
    assert kv.append("a", 5) and len(kv.block_ids("a")) == 2
    assert kv.append("a", 12) and len(kv.block_ids("a")) == 3
    assert not kv.append("a", 13)
    assert len(kv.block_ids("a")) == 3


def test_committed_full_blocks_are_shared_by_the_next_identical_prompt() -> None:
    kv = make(8)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    kv.allocate("a", prompt, 10)
    assert kv.num_cached_prefix_tokens(prompt) == 0  # not committed yet
    kv.commit("a", prompt, 10)
    assert kv.num_cached_prefix_tokens(prompt) == 8
    assert kv.allocate("b", prompt, 10) == 8
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    assert [kv.ref_count(b) for b in shared] == [2, 2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]  # the partial block is private
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_fully_cached_prompt_still_leaves_its_last_token_to_compute() -> None:
    kv = make(8)
    prompt = list(range(8))  # exactly 2 blocks
    kv.allocate("a", prompt, 8)
    kv.commit("a", prompt, 8)
    assert kv.num_cached_prefix_tokens(prompt) == 4
    assert kv.allocate("b", prompt, 8) == 4


def test_same_block_tokens_under_a_different_prefix_do_not_match() -> None:
    kv = make(8)
    first = [1, 1, 1, 1, 9, 9, 9, 9, 5]
    kv.allocate("a", first, 9)
    kv.commit("a", first, 9)
    other = [2, 2, 2, 2, 9, 9, 9, 9, 5]  # second block equal, parent differs
    assert kv.num_cached_prefix_tokens(other) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_lru() -> None:
    kv = make(4)
    old = [7] * 8 + [1]
    kv.allocate("a", old, 9)
    kv.commit("a", old, 9)
    kv.free("a")
    assert kv.num_free_blocks == 4  # cached-unused blocks count as free
    assert kv.num_cached_prefix_tokens(old) == 8
    kv.allocate("b", [3] * 8, 8)  # takes the two uncached blocks first
    assert kv.num_cached_prefix_tokens(old) == 8
    kv.allocate("c", [4] * 4, 4)  # now evicts a cached block: the prefix's tail first
    assert kv.num_cached_prefix_tokens(old) == 4
    kv.allocate("d", [5] * 4, 4)
    assert kv.num_cached_prefix_tokens(old) == 0
    assert kv.num_free_blocks == 0


def test_a_referenced_block_is_never_handed_out() -> None:
    kv = make(4)
    prompt = [1] * 8 + [2]
    kv.allocate("a", prompt, 9)
    kv.commit("a", prompt, 9)
    held = set(kv.block_ids("a"))
    assert kv.allocate("b", [3] * 5, 5) is None  # needs 2, only 1 free
    kv.allocate("b", [3], 1)
    assert not set(kv.block_ids("b")) & held
    assert not kv.append("b", 5)


def test_prefix_caching_off_never_shares() -> None:
    kv = make(8, caching=False)
    prompt = list(range(9))
    kv.allocate("a", prompt, 9)
    kv.commit("a", prompt, 9)
    assert kv.num_cached_prefix_tokens(prompt) == 0
    assert kv.allocate("b", prompt, 9) == 0
    assert not set(kv.block_ids("a")) & set(kv.block_ids("b"))


def test_duplicate_content_commit_keeps_chain_matchable() -> None:
    kv = make(12)
    prompt = list(range(13))
    kv.allocate("a", prompt, 13)
    kv.allocate("b", prompt, 13)  # both computed the prompt concurrently
    kv.commit("a", prompt, 13)
    kv.commit("b", prompt, 13)
    assert kv.num_cached_blocks == 3
    kv.free("a")
    assert kv.num_cached_prefix_tokens(prompt) == 12


def test_allocating_twice_for_one_request_is_an_error() -> None:
    kv = make(4)
    kv.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate("a", [1], 1)


def test_a_block_registered_after_a_prefix_hit_chains_to_the_hit() -> None:
    """Found by the scheduler property test (pipelined, chunked prefill): a request that
    hit cached blocks and then took fresh ones registered its next block under the
    fresh block's (root) key id, as if that block began a prompt, so a prompt starting
    with those tokens got a block computed at another position."""
    kv = make(num_blocks=8)  # block_size 4
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    kv.allocate("a", shared + [9], 9)
    kv.commit("a", shared + [9], 8)  # two cached blocks
    kv.free("a")
    tokens = shared + [10, 11, 12, 13, 14]
    assert kv.allocate("b", tokens, len(tokens)) == 8  # hits both, one fresh block
    kv.commit("b", tokens, 12)  # registers block 2: [10, 11, 12, 13]
    third = kv.block_ids("b")[2]
    # a prompt that starts with block 2's tokens must not reuse it at position 0
    other = [10, 11, 12, 13, 99]
    assert kv.allocate("c", other, len(other)) == 0
    assert third not in kv.block_ids("c")
    # the chain still serves the same prefix at the right position
    again = tokens + [15]
    assert kv.allocate("d", again, len(again)) == 12
    assert kv.block_ids("d")[:3] == kv.block_ids("b")[:3]
