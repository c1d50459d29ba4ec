"""Tokenize long texts into one flat int64 tensor (the tokenizer's own special tokens, as GPTQ/AWQ scripts do)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def encode(tokenizer, text: str) -> torch.Tensor:
    import torch
    from transformers.utils import logging as hf_logging

    # A whole corpus is longer than model_max_length on purpose; silence that one warning.
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        ids = tokenizer(text, return_attention_mask=False)["input_ids"]
    finally:
        hf_logging.set_verbosity(previous)
    return torch.tensor(ids, dtype=torch.long)
