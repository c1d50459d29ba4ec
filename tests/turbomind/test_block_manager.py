"""Block manager without tensors: ref counts, prefix hash chain reuse, LRU eviction, no leaks."""

from __future__ import annotations

from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.sequence import Sequence


def _admit_all(bm: BlockManager, seq: Sequence) -> int:
    matched = bm.match_prefix(seq.token_ids)
    assert bm.can_admit(matched, len(seq))
    bm.admit(seq, matched, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit_full_blocks(seq)
    return len(matched) * bm.block_size


def test_alloc_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence(0, list(range(10))), Sequence(1, list(range(100, 105)))
    _admit_all(bm, a)
    _admit_all(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_used == 5 and bm.num_free == 3
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and bm.num_used == 0 and not a.block_table


def test_prefix_chain_reuse_shares_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(0, list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert _admit_all(bm, first) == 0
    bm.free(first)
    assert bm.num_cached_free == 2  # the two full blocks stay reusable
    second = Sequence(1, list(range(10)) + [50, 51, 52])
    assert _admit_all(bm, second) == 8
    assert second.block_table[:2] == [bm._by_hash[h] for h in second.block_hashes[:2]]
    # same tokens in a different order: the chain differs from the first block on
    other = Sequence(2, list(range(4, 8)) + list(range(4)) + [1])
    assert bm.match_prefix(other.token_ids) == []


def test_prefix_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    _admit_all(bm, Sequence(0, list(range(8))))
    again = Sequence(1, list(range(8)))
    assert len(bm.match_prefix(again.token_ids)) == 1  # the last block is recomputed to get logits


def test_shared_block_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(0, list(range(9)))
    _admit_all(bm, a)
    b = Sequence(1, list(range(9)))
    assert _admit_all(bm, b) == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_used == 4  # 2 shared + 1 tail each
    bm.free(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1 and bm.num_used == 3
    bm.free(b)
    assert bm.num_free == 8


def test_lru_evicts_least_recently_freed_and_prefers_plain_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = Sequence(0, [1, 2, 9]), Sequence(1, [3, 4, 9])
    _admit_all(bm, old)
    _admit_all(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_free == 2 and bm.num_free == 4
    # two plain blocks are free: taking them evicts nothing
    bm.allocate_blocks(2)
    assert len(bm.match_prefix([1, 2, 0])) == 1 and len(bm.match_prefix([3, 4, 0])) == 1
    # one more block evicts the least recently freed cached block: `old`'s
    bm.allocate_blocks(1)
    assert bm.match_prefix([1, 2, 0]) == [] and len(bm.match_prefix([3, 4, 0])) == 1


def test_reusing_a_cached_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence(0, [1, 2, 3])
    _admit_all(bm, a)
    bm.free(a)
    b = Sequence(1, [1, 2, 3, 4, 5])
    matched = bm.match_prefix(b.token_ids)
    assert len(matched) == 1
    assert bm.can_admit(matched, 5)  # 1 reused + 2 new of 3 free
    assert not bm.can_admit(matched, 7)
    bm.admit(b, matched, 5)
    assert bm.num_free == 0
    bm.free(b)
    assert bm.num_free == 3


def test_append_slots_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = Sequence(0, [1, 2, 3, 4])
    bm.admit(seq, [], 4)
    seq.num_computed_tokens = 4
    assert not bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2 and bm.num_free == 0


def test_prefix_caching_off_never_shares_blocks(tiny_llama_ws) -> None:
    """enable_prefix_caching=False (serve --no-enable-prefix-caching): a repeated prompt is computed again."""
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.gen_config import GenerationConfig

    prompt = list(range(100, 130))
    for enabled, hits in ((True, 28), (False, 0)):
        engine = Engine(tiny_llama_ws[1], start=False, cache_block_seq_len=4, cache_max_entry_count=64,
                        enable_prefix_caching=enabled)
        for _ in range(2):
            engine.generate(prompt, GenerationConfig(max_new_tokens=2, temperature=0))
            while engine.step():
                pass
        stats = engine.stats()
        assert stats.prefix_hit_tokens == hits and stats.blocks_cached == (7 if enabled else 0)
