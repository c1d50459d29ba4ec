"""KV block allocation with reference counts and a prefix cache over full blocks.

A full block is named by a chain hash: hash(parent block's hash, its tokens). Equal chains mean equal KV (same
tokens at the same positions from the start), so a new sequence whose prompt starts with a cached chain takes those
blocks by reference instead of recomputing them. Rules that must stay true:
- only full blocks whose KV is computed are hashed (`commit_full_blocks`); a partial block is never shared;
- a block with ref_count 0 and a hash stays in `_cached` (LRU order) and is reusable until it is evicted, which
  happens only when no never-hashed block is free;
- `num_free` counts both kinds, so `num_free + num_used == num_blocks` always.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from lmd.turbomind.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


def chain_hash(parent: int | None, tokens: list[int] | tuple[int, ...]) -> int:
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        """enable_caching=False: no block is ever hashed, so no prompt takes another's KV (every prompt computed)."""
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._plain: deque[int] = deque(range(num_blocks))  # free, never hashed (or hash dropped)
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but hashed, least recently freed first
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks for the longest prefix of full blocks, leaving at least one token to compute (its logits)."""
        matched: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size if self.enable_caching else 0):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._by_hash.get(parent)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def can_admit(self, matched: list[int], num_tokens: int) -> bool:
        """Room for a sequence that takes `matched` by reference and needs KV for `num_tokens` tokens in all?"""
        reused_free = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(matched) <= self.num_free - reused_free

    def admit(self, seq: Sequence, matched: list[int], num_tokens: int) -> None:
        assert not seq.block_table, "a sequence is admitted with no blocks"
        parent = None
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent = block.hash
            seq.block_hashes.append(parent)  # type: ignore[arg-type]
        self._grow(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` more tokens after the computed ones; False (nothing changed) if out of blocks."""
        needed = self.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        if needed > self.num_free:
            return False
        self._grow(seq, seq.num_computed_tokens + num_tokens)
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full of computed KV, making them reusable by later prompts."""
        if not self.enable_caching:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        known = min(seq.num_computed_tokens, len(seq.token_ids))  # an in-flight token's id is not known yet
        for i in range(len(seq.block_hashes), known // self.block_size):
            parent = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(parent)
            if parent not in self._by_hash:  # an equal chain computed twice keeps the first block only
                block = self.blocks[seq.block_table[i]]
                block.hash = parent
                self._by_hash[parent] = block.block_id

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None | bool:
        """Give `child` the KV of `parent`'s first num_tokens tokens: the full blocks shared (reference counts), a
        partly filled last block copied (copy-on-write at the fork: both will write into it). Returns the (source,
        destination) block pair to copy on the device, None when nothing needs copying, False (nothing changed) when
        no block is free for the copy."""
        assert not child.block_table, "a sequence is forked with no blocks"
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.num_free:
            return False
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.block_hashes.extend(parent.block_hashes[:full])
        if not partial:
            return None
        copy = self._take()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def free(self, seq: Sequence) -> None:
        # the tail goes first, so in LRU order a chain's last blocks are evicted before its shared head
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self._plain.append(block_id)
                else:
                    self._cached[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (speculative decoding: they held rejected proposals
        only, so they are the sequence's own and never hashed)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, f"block {block.block_id} trimmed while shared"
            block.ref_count = 0
            self._plain.append(block.block_id)

    def allocate_blocks(self, count: int) -> list[int]:
        """Unhashed blocks outside any sequence (e.g. a scoring window); give them back with `release_blocks`."""
        if count > self.num_free:
            raise ValueError(f"{count} blocks requested, {self.num_free} free")
        return [self._take() for _ in range(count)]

    def release_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.blocks[block_id].ref_count -= 1
            self._plain.append(block_id)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take())

    def _take(self) -> int:
        if self._plain:
            block_id = self._plain.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)  # evict the least recently freed cached block
            evicted = self.blocks[block_id]
            del self._by_hash[evicted.hash]  # type: ignore[arg-type]
            evicted.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id
