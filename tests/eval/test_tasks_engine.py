"""The engine backend (prompt logprobs over the paged KV cache) scores exactly what transformers does on an fp32
tiny workspace: log-likelihoods within 1e-4, the same greedy flags, the same accuracies."""

from __future__ import annotations

import pytest

from lmd.eval.tasks.formats import Item, TaskSet, lambada_item, winogrande_item
from lmd.eval.tasks.scoring import score_task

REQUESTS = [
    ("Question: Which gas do plants take in?\nAnswer:", " carbon dioxide"),
    ("Question: Which gas do plants take in?\nAnswer:", " oxygen"),
    ("Pole vault: Pole vault is a sport where you run with a pole. A few women",
     " are in the gym practicing to do this pole vault, trying to do their best."),
    ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."),
    ("the cat sat on the", " mat"),
    ("a", " b"),
    ("Answer: ", "yes"),  # trailing space moves onto the continuation
]


@pytest.fixture(scope="module")
def backends(tiny_llama_ws):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmd.eval.tasks.backends import EngineBackend, HfBackend
    from lmd.turbomind.engine import Engine

    hf_dir, workspace = tiny_llama_ws
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32").eval()
    hf = HfBackend(model, AutoTokenizer.from_pretrained(hf_dir), "hf", batch_size=3)
    engine = Engine(workspace, device="cpu", dtype="fp32", cache_block_seq_len=4, max_batch_size=4)
    yield hf, EngineBackend(engine, "engine", batch=5)
    engine.close()


def test_engine_loglikelihoods_equal_transformers(backends):
    hf, engine = backends
    want, got = hf.loglikelihood(REQUESTS), engine.loglikelihood(REQUESTS)
    for (ll_hf, greedy_hf), (ll_engine, greedy_engine) in zip(want, got, strict=True):
        assert ll_engine == pytest.approx(ll_hf, abs=1e-4) and greedy_engine == greedy_hf
    assert all(ll < 0 for ll, _ in want)


def test_engine_task_scores_equal_transformers(backends):
    hf, engine = backends
    q = "Question: Which is a mammal?\nAnswer:"
    choices = Item(tuple((q, " " + c) for c in ("whale", "shark", "trout", "a small green frog")), 0, (5, 5, 5, 18))
    wino = winogrande_item({"context_options": ["The trophy did not fit in the case because the trophy",
                                                "The trophy did not fit in the case because the case"],
                            "continuation": "was too big.", "gold": 0})
    for task in (TaskSet("arc_easy", [choices], "mem"), TaskSet("winogrande", [wino], "mem"),
                 TaskSet("lambada", [lambada_item("he opened the door and saw his dog"), lambada_item("x y")], "mem",
                         greedy=True)):
        a, b = score_task(task, hf), score_task(task, engine)
        assert (a.acc, a.acc_norm) == (b.acc, b.acc_norm)


def test_greedy_flags_agree_on_a_greedy_continuation(backends):
    import torch

    hf, engine = backends
    context = "the cat sat on the"
    ids = hf.tokenizer.encode(context, add_special_tokens=False)
    with torch.inference_mode():
        best = int(hf.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
    request = (context, hf.tokenizer.decode([best]))
    (ll_hf, greedy_hf), = hf.loglikelihood([request])
    (ll_engine, greedy_engine), = engine.loglikelihood([request])
    assert greedy_hf and greedy_engine and ll_engine == pytest.approx(ll_hf, abs=1e-4)
