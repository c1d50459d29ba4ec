"""Shared memory for the lane-level emulations of lmd's CUDA kernels: 32-bit words addressed in bytes, accesses of
2, 4, 8 or 16 bytes a lane, and the bank conflicts of each warp's access counted the way the hardware serves it
(a 16-byte access in phases of 8 lanes, an 8-byte one in phases of 16, smaller ones all 32 lanes at once; lanes
that share a word are served together)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SharedMemory:
    size: int
    words: torch.Tensor = field(init=False)
    conflicts: int = 0

    def __post_init__(self) -> None:
        self.words = torch.full((self.size // 4,), -1, dtype=torch.int64)  # garbage until written

    def _index(self, addresses: torch.Tensor, nbytes: int) -> torch.Tensor:
        assert bool((addresses % nbytes == 0).all()), "misaligned shared access"
        assert bool((addresses >= 0).all() and (addresses + nbytes <= self.size).all()), "shared access out of bounds"
        return (addresses // 4)[:, None] + torch.arange(max(nbytes // 4, 1))

    def _count(self, addresses: torch.Tensor, nbytes: int) -> None:
        """Bank conflicts of one access by every warp among `addresses` (lanes in order, 32 a warp)."""
        lanes_per_phase = 32 // max(nbytes // 4, 1)
        for p in range(0, len(addresses), lanes_per_phase):
            words = torch.unique(self._index(addresses[p:p + lanes_per_phase], nbytes).flatten())
            self.conflicts += len(words) - len(torch.unique(words % 32))

    def copy16(self, addresses: torch.Tensor, source: torch.Tensor, valid: torch.Tensor) -> None:
        """cp.async of 16 bytes per address (source [L, 4] words); invalid ones are zero-filled."""
        self.words[self._index(addresses, 16)] = torch.where(valid[:, None], source, torch.zeros_like(source))

    def load(self, addresses: torch.Tensor, width: int) -> torch.Tensor:
        """ld.shared of `width` 32-bit words a lane: [L] byte addresses -> [L, width]."""
        self._count(addresses, 4 * width)
        return self.words[self._index(addresses, 4 * width)]

    def load16(self, addresses: torch.Tensor) -> torch.Tensor:
        """ld.shared.u16: [L] byte addresses -> [L] half-words."""
        self._count(addresses, 2)
        return (self.words[addresses // 4] >> (8 * (addresses % 4))) & 0xFFFF

    def store(self, addresses: torch.Tensor, values: torch.Tensor) -> None:
        """st.shared of values [L, width] 32-bit words a lane."""
        self._count(addresses, 4 * values.shape[1])
        self.words[self._index(addresses, 4 * values.shape[1])] = values

    def store16(self, addresses: torch.Tensor, halves: torch.Tensor) -> None:
        """st.shared.u16 of halves [L]."""
        self._count(addresses, 2)
        assert bool((addresses % 2 == 0).all()), "misaligned shared access"
        words, shift = addresses // 4, 8 * (addresses % 4)
        for i in range(len(addresses)):  # lanes may share a word: one at a time
            w = int(words[i])
            self.words[w] = (self.words[w] & ~(0xFFFF << int(shift[i]))) | (int(halves[i]) << int(shift[i]))
