"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last n
tokens (prompt and output so far), trying the longest n first.

The index is incremental: each n-gram is entered once, when the token after it is known, under its end position, so
a lookup costs O(max n) whatever the sequence's length. An n-gram is indexed only once a token follows it, so the
sequence's own suffix never matches itself.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the tokens after it, in order
        self._indexed = 0  # tokens token_ids[:_indexed] have their n-grams ending before them entered

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens continuing `token_ids` (which only ever grows), or [] when no n-gram matches."""
        found = self.propose_many(token_ids, limit, 1)
        return found[0] if found else []

    def propose_many(self, token_ids: list[int], limit: int, matches: int) -> list[list[int]]:
        """Up to `matches` distinct continuations of `limit` tokens at most, latest occurrence first, from the
        longest n-gram that matches (a token tree's chains)."""
        self._extend(token_ids)
        if limit <= 0:
            return []
        end = len(token_ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            follows = self._follows.get(tuple(token_ids[end - n:]))
            if follows is None:
                continue
            out: list[list[int]] = []
            for follow in reversed(follows[-4 * matches:]):  # a few recent occurrences are enough
                chain = token_ids[follow:follow + limit]
                if chain not in out:
                    out.append(chain)
                if len(out) == matches:
                    break
            return out
        return []

    def _extend(self, token_ids: list[int]) -> None:
        for follow in range(max(self._indexed, 1), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, follow) + 1):
                self._follows.setdefault(tuple(token_ids[follow - n:follow]), []).append(follow)
        self._indexed = max(self._indexed, len(token_ids))
