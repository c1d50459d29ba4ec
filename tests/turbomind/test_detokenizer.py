from __future__ import annotations

import random

import pytest

from lmd.turbomind.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Café naïve résumé — déjà vu… ¿Qué tal? Übermäßig.",
    "中文测试：你好，世界！日本語のテキストも。한국어도.",
    "Emoji: 🎉🚀 👩‍💻 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done.",
    "  leading spaces,\ttabs\nand\n\nnewlines   trailing  ",
    "mixed 🎉中文é at the end 🚀",
]


def stream(tokenizer, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.token_ids == ids
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    deltas = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multi_token_characters_are_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji; otherwise this test checks nothing
    deltas = stream(tokenizer, [], ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🎉"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Done. 你好", add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas = stream(tokenizer, [], ids, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_invalid_bytes_are_held_until_flush(tokenizer):
    lone = tokenizer.encode("🎉", add_special_tokens=False)[:1]  # the first byte of a 4-byte character, alone
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(lone[0]) == ""
    assert detok.flush() == tokenizer.decode(lone)


def test_random_texts_and_random_ids_stream_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    pool = [*"abc xyz,.!?\n\t", *"éüßñçø", *"中文日本語한국어", "🎉", "👩‍💻", "🇫🇷", "\u0301", "𝔘"]
    for _ in range(60):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        deltas = stream(tokenizer, [], tokenizer.encode(text, add_special_tokens=False))
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    for _ in range(60):  # arbitrary ids may be invalid UTF-8: the stream still equals one decode of them all
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_backend_decode_is_used_and_equals_transformers_decode(tokenizer):
    from lmd.turbomind.detokenizer import backend_decoder

    decode = backend_decoder(tokenizer)
    assert decode is not None  # SmolLM2: a fast tokenizer without space clean-up
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_tokenizers_that_clean_up_spaces_keep_transformers_decode(tokenizer, monkeypatch):
    from lmd.turbomind.detokenizer import backend_decoder

    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert backend_decoder(tokenizer) is None
    assert backend_decoder(object()) is None  # no backend at all (a slow tokenizer)
