"""Calibration windows: shapes, seed determinism, where windows come from, and the too-little-data errors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from lmd.calib_data import CalibSet, get_calib_samples
from lmd.calib_data.sources import load_rows
from lmd.calib_data.tokenization import encode
from lmd.errors import LmdError

MIRROR = Path(os.environ["LMD_DATA_DIR"])


def _is_slice_of(window: torch.Tensor, stream: torch.Tensor) -> bool:
    hits = (stream[: stream.numel() - window.numel() + 1] == window[0]).nonzero().flatten()
    return any(torch.equal(stream[i:i + window.numel()], window) for i in hits.tolist())


def test_pydoc_windows_are_seeded_slices_of_the_joined_text(tokenizer):
    calib = get_calib_samples("pydoc", tokenizer, nsamples=6, seqlen=64, seed=0)
    assert isinstance(calib, CalibSet)
    assert calib.input_ids.shape == (6, 64) and calib.input_ids.dtype == torch.int64
    assert (calib.dataset, calib.split, calib.nsamples, calib.seqlen) == ("pydoc", "train", 6, 64)
    stream = encode(tokenizer, load_rows("pydoc", "train").text)
    rng = random.Random(0)
    starts = [rng.randint(0, stream.numel() - 64 - 1) for _ in range(6)]
    assert torch.equal(calib.input_ids, torch.stack([stream[s:s + 64] for s in starts]))


def test_same_seed_same_windows_other_seed_other_windows(tokenizer):
    a = get_calib_samples("pydoc", tokenizer, nsamples=4, seqlen=32, seed=0)
    b = get_calib_samples("pydoc", tokenizer, nsamples=4, seqlen=32, seed=0)
    c = get_calib_samples("pydoc", tokenizer, nsamples=4, seqlen=32, seed=1)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_sampling_leaves_the_global_random_state_alone(tokenizer):
    random.seed(123)
    expected = random.random()
    random.seed(123)
    get_calib_samples("pydoc", tokenizer, nsamples=2, seqlen=16)
    assert random.random() == expected


@pytest.mark.skipif(not (MIRROR / "c4").is_dir(), reason="no local c4 mirror")
def test_c4_windows_lie_inside_single_long_documents(tokenizer):
    calib = get_calib_samples("c4", tokenizer, nsamples=5, seqlen=256, seed=0, data_dir=str(MIRROR))
    assert calib.input_ids.shape == (5, 256) and calib.split == "train"
    docs = load_rows("c4", "train", str(MIRROR)).rows
    rng = random.Random(0)
    for window in calib.input_ids:
        # replay GPTQ's loop: random docs until one is longer than seqlen, then a random start inside it
        while True:
            ids = encode(tokenizer, docs[rng.randint(0, len(docs) - 1)])
            if ids.numel() > 256:
                break
        start = rng.randint(0, ids.numel() - 256 - 1)
        assert torch.equal(window, ids[start:start + 256])


def test_c4_style_error_when_no_document_is_long_enough(tmp_path, tokenizer):
    (tmp_path / "c4").mkdir()
    (tmp_path / "c4" / "c4-en-train.tiny.jsonl").write_text(
        "\n".join(json.dumps({"text": f"short doc {i}"}) for i in range(4)), encoding="utf-8")
    with pytest.raises(LmdError, match="no c4 \\(train\\) document is longer than 64 tokens"):
        get_calib_samples("c4", tokenizer, nsamples=2, seqlen=64, data_dir=str(tmp_path))


def test_pileval_concatenates_short_documents_into_blocks(tmp_path, tokenizer):
    (tmp_path / "pileval").mkdir()
    docs = [f"  Document number {i} talks about topic {i * 7}.  " for i in range(40)]
    docs.append("word " * 600)  # longer than 512 tokens: skipped
    (tmp_path / "pileval" / "val.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs),
                                                    encoding="utf-8")
    calib = get_calib_samples("pileval", tokenizer, nsamples=3, seqlen=20, seed=0, data_dir=str(tmp_path))
    assert calib.input_ids.shape == (3, 20) and calib.split == "validation"
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    pieces = [encode(tokenizer, docs[i].strip()) for i in order]
    stream = torch.cat([p for p in pieces if 0 < p.numel() <= 512])
    assert torch.equal(calib.input_ids.flatten(), stream[:60])


def test_pileval_too_few_tokens_is_an_error(tmp_path, tokenizer):
    (tmp_path / "pileval").mkdir()
    (tmp_path / "pileval" / "val.jsonl").write_text(json.dumps({"text": "tiny"}), encoding="utf-8")
    with pytest.raises(LmdError, match="lower --calib-samples"):
        get_calib_samples("pileval", tokenizer, nsamples=4, seqlen=64, data_dir=str(tmp_path))


def test_user_file_windows_and_too_short_text(tmp_path, tokenizer):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 50, encoding="utf-8")
    calib = get_calib_samples(str(path), tokenizer, nsamples=3, seqlen=48)
    assert calib.input_ids.shape == (3, 48) and calib.dataset == str(path) and calib.split == "all"
    with pytest.raises(LmdError, match="too few for 4096-token windows"):
        get_calib_samples(str(path), tokenizer, nsamples=1, seqlen=4096)


@pytest.mark.skipif(not (MIRROR / "wikitext-2-raw").is_dir(), reason="no local wikitext mirror")
def test_wikitext2_calibration_falls_back_to_validation(tokenizer, capsys):
    calib = get_calib_samples("wikitext2", tokenizer, nsamples=2, seqlen=128, data_dir=str(MIRROR))
    assert calib.split == "validation" and calib.input_ids.shape == (2, 128)
    assert "wikitext2 has no train split" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [({"nsamples": 0}, "--calib-samples"), ({"seqlen": 1}, "--calib-seqlen")])
def test_bad_sizes_are_rejected(tokenizer, kwargs, message):
    with pytest.raises(LmdError, match=message):
        get_calib_samples("pydoc", tokenizer, **kwargs)
