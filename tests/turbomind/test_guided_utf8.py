"""Guided replies hold no encoded surrogates: xgrammar takes ED A0 80 (U+D800, forbidden in UTF-8) as a character
inside a JSON string, and the guard masks it out, through rollback and fork too."""

from __future__ import annotations

import json

import pytest
import torch

from lmd.turbomind.guided import GrammarCompiler, GuidedSpec, _tokenizer_info, allocate_bitmask
from lmd.turbomind.guided_utf8 import LeadState, SurrogateGuard

xgr = pytest.importorskip("xgrammar")

VOCAB = 49152
EOS = 2
TITLE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 8}}, "required": ["title"]}


def _allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool(int(mask_row[token // 32]) >> (token % 32) & 1)


def test_guard_masks_built_from_raw_bytes() -> None:
    vocab = [b"", b"a", b"\xed", b"\xa0\x80", b"x\xed\xa0", b"\x80", b"\xed\x9f"]
    guard = SurrogateGuard(vocab, 1)
    anywhere = [_allowed(guard.anywhere, t) for t in range(len(vocab))]
    after_lead = [_allowed(guard.after_lead, t) for t in range(len(vocab))]
    assert anywhere == [True, True, True, True, False, True, True]  # only ED A0 inside one token
    assert after_lead == [True, True, True, False, True, True, True]  # A0.. may not follow a lone ED
    assert guard.ends_in_lead == {2} and guard.empty == {0}
    state = LeadState()
    for token in (1, 2, 0):  # "a", ED, a special token: still after a lone ED
        state.accept(guard, token)
    assert state.after_lead
    forked = state.fork()
    state.rollback(2)
    assert not state.after_lead and forked.after_lead
    forked.accept(guard, 5)  # ED 80: U+D000's first two bytes, no lone lead any more
    assert not forked.after_lead


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def test_a_surrogate_is_refused_after_a_lone_lead_byte(compiler, tokenizer) -> None:
    spec = GuidedSpec.from_json_schema(TITLE)
    matcher = compiler.matcher(spec)
    decoded = _tokenizer_info(xgr, tokenizer, VOCAB, (EOS,)).decoded_vocab
    single = {v[0]: i for i, v in enumerate(decoded) if len(v) == 1}
    prefix = tokenizer.encode('{"title": "_ Neuro', add_special_tokens=False)
    for token in [*prefix, single[0xED]]:
        assert matcher.accept(token)
    # xgrammar 0.2.9 alone would take ED A0 .. as a character here (the guard's reason, see guided_utf8)
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(mask, 0)
    assert not any(_allowed(mask[0], single[b]) for b in range(0xA0, 0xC0))
    assert _allowed(mask[0], single[0x80])  # ED 80 80 is U+D000, a character
    fork = matcher.fork()
    matcher.rollback(1)  # back before the ED: A0 is refused by the grammar, not by the guard
    mask = allocate_bitmask(1, VOCAB)
    fork.fill_next_token_bitmask(mask, 0)
    assert not _allowed(mask[0], single[0xA0])
    assert fork.accept(single[0x80]) and fork.accept(single[0x80])
    text = b"_ Neuro\xed\x80\x80".decode("utf-8")
    assert json.loads('{"title": "' + text + '"}')["title"] == text and len(text) == 8
