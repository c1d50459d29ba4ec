"""lmd.pipeline over a workspace and over an HF model directory (deployed into a temporary workspace)."""

from __future__ import annotations

import sys

import lmd
from lmd.turbomind.gen_config import GenerationConfig

GREEDY = GenerationConfig(max_new_tokens=6, temperature=0, ignore_eos=True)


def test_pipeline_on_a_workspace_and_on_a_model_dir(tiny_llama_ws):
    src, ws = tiny_llama_ws
    with lmd.pipeline(ws, cache_block_seq_len=4, cache_max_entry_count=32) as pipe:
        batch = pipe(["Hi", "Tell me a joke"], GREEDY)
        single = pipe("Hi", GREEDY)
        streamed = [d for i, d in pipe.stream_infer(["Hi"], GREEDY)]
    assert [len(r.token_ids) for r in batch] == [6, 6] and all(r.finish_reason == "length" for r in batch)
    assert single.token_ids == batch[0].token_ids and single.text == batch[0].text
    assert [t for d in streamed for t in d.token_ids] == single.token_ids

    with lmd.pipeline(src, model_name="hf", deploy_options={"dtype": "float32"}, cache_block_seq_len=4,
                      cache_max_entry_count=32) as pipe:
        tmp = pipe._tmp
        assert tmp is not None and tmp.is_dir()
        assert pipe("Hi", GREEDY).token_ids == single.token_ids
    assert not tmp.exists()


def test_import_lmd_does_not_import_torch():
    import subprocess

    code = "import sys, lmd; assert 'torch' not in sys.modules; lmd.__version__"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
