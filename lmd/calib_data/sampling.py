"""Calibration windows, following LMDeploy/GPTQ sampling with a local `random.Random(seed)` (no global state).

- wikitext2, ptb, pydoc and user paths: tokenize the joined text once, then `nsamples` windows of `seqlen` tokens
  starting at `randint(0, T - seqlen - 1)` (GPTQ's `get_wikitext2`/`get_ptb`).
- c4: pick a random document until one is longer than `seqlen` tokens, then a random window inside it (GPTQ's
  `get_c4`).
- pileval: documents in a seeded random order, stripped, kept when 1..512 tokens long, concatenated until
  `nsamples * seqlen` tokens are gathered, then cut into `seqlen` blocks (LMDeploy/AutoAWQ `get_pileval`; they stop
  after `nsamples` documents, lmd stops when `nsamples` full blocks exist so the shape is always [nsamples, seqlen]).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.calib_data.sources import Rows, load_rows
from lmd.calib_data.tokenization import encode
from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch

PILEVAL_MAX_DOC_TOKENS = 512
DEFAULT_CALIB_SPLIT = {"wikitext2": "train", "ptb": "train", "c4": "train", "pileval": "validation", "pydoc": "train"}


@dataclass(frozen=True)
class CalibSet:
    input_ids: torch.Tensor  # int64 [nsamples, seqlen]
    dataset: str
    split: str
    source: str
    seed: int = 0

    @property
    def nsamples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.input_ids.shape[1])


def get_calib_samples(dataset: str, tokenizer, nsamples: int = 128, seqlen: int = 2048, seed: int = 0,
                      split: str | None = None, data_dir: str | None = None) -> CalibSet:
    """`nsamples` windows of `seqlen` tokens from `dataset` (a name of DATASETS or a path)."""
    if nsamples < 1:
        raise LmdError(f"--calib-samples must be at least 1 (got {nsamples})")
    if seqlen < 2:
        raise LmdError(f"--calib-seqlen must be at least 2 (got {seqlen})")
    rows = load_rows(dataset, split or DEFAULT_CALIB_SPLIT.get(dataset, "train"), data_dir)
    rng = random.Random(seed)
    if rows.dataset == "c4":
        windows = _document_windows(rows, tokenizer, nsamples, seqlen, rng)
    elif rows.dataset == "pileval":
        windows = _pileval_blocks(rows, tokenizer, nsamples, seqlen, rng)
    else:
        windows = _text_windows(rows, tokenizer, nsamples, seqlen, rng)
    return CalibSet(windows, rows.dataset, rows.split, rows.source, seed)


def _text_windows(rows: Rows, tokenizer, nsamples: int, seqlen: int, rng: random.Random) -> torch.Tensor:
    import torch

    ids = encode(tokenizer, rows.text)
    if ids.numel() <= seqlen:
        raise LmdError(f"{rows.dataset} ({rows.split}) has {ids.numel()} tokens, too few for {seqlen}-token "
                       "windows; use a smaller --calib-seqlen or a larger data set")
    starts = [rng.randint(0, ids.numel() - seqlen - 1) for _ in range(nsamples)]
    return torch.stack([ids[s:s + seqlen] for s in starts])


def _document_windows(rows: Rows, tokenizer, nsamples: int, seqlen: int, rng: random.Random) -> torch.Tensor:
    import torch

    cache: dict[int, torch.Tensor] = {}
    long_docs = 0
    windows = []
    while len(windows) < nsamples:
        index = rng.randint(0, len(rows.rows) - 1)
        if index not in cache:
            cache[index] = encode(tokenizer, rows.rows[index])
            long_docs += cache[index].numel() > seqlen
        ids = cache[index]
        if ids.numel() > seqlen:
            start = rng.randint(0, ids.numel() - seqlen - 1)
            windows.append(ids[start:start + seqlen])
        elif long_docs == 0 and len(cache) == len(rows.rows):
            raise LmdError(f"no {rows.dataset} ({rows.split}) document is longer than {seqlen} tokens; "
                           "use a smaller --calib-seqlen or another --calib-dataset")
    return torch.stack(windows)


def _pileval_blocks(rows: Rows, tokenizer, nsamples: int, seqlen: int, rng: random.Random) -> torch.Tensor:
    import torch

    order = list(range(len(rows.rows)))
    rng.shuffle(order)
    pieces: list[torch.Tensor] = []
    total = 0
    for index in order:
        ids = encode(tokenizer, rows.rows[index].strip())
        if ids.numel() == 0 or ids.numel() > PILEVAL_MAX_DOC_TOKENS:
            continue
        pieces.append(ids)
        total += ids.numel()
        if total >= nsamples * seqlen:
            return torch.cat(pieces)[:nsamples * seqlen].view(nsamples, seqlen)
    raise LmdError(f"{rows.dataset} ({rows.split}) has only {total} tokens in documents of at most "
                   f"{PILEVAL_MAX_DOC_TOKENS} tokens, fewer than {nsamples} x {seqlen}; lower --calib-samples "
                   "or --calib-seqlen")
