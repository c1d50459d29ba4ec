"""benchmarks/decode_vs_lmdeploy.py --tiny on CPU with gpt-fast from the peers folder (LMDeploy skipped), and the
gpt-fast child's weight mapping: gpt-fast's model on lmd's workspace computes what transformers' Llama computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "decode_vs_lmdeploy.py"
PEERS = next((p for p in (ROOT.parent / "shared" / "peers", Path("/work/shared/peers"))
              if (p / "gpt-fast" / "model.py").is_file()), None)
needs_gpt_fast = pytest.mark.skipif(PEERS is None, reason="no shared/peers/gpt-fast beside the checkout")

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_tiny_run_puts_gpt_fast_beside_lmd(tmp_path):
    peers = PEERS if PEERS is not None else tmp_path / "no-peers"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--peers", str(peers), "--no-peer"],
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "decode_vs_lmdeploy.json").read_text())
    assert "LMDeploy 0.18 PT" not in report
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["batch"])
    assert lines[header].rstrip().endswith("gpt-fast")
    gpt_fast = report["gpt-fast"]
    if PEERS is None:
        assert "skipped" in gpt_fast and [line.split()[-1] for line in lines[header + 1:header + 3]] == ["—", "—"]
        return
    assert gpt_fast["compiled"] is False and "failed" not in gpt_fast
    assert sorted(gpt_fast["rows"]) == ["1", "4"]
    for row in gpt_fast["rows"].values():
        assert row["decode_ms_mean"] > 0 and len(row["first_ids"]) == 8
    rows = [line.split() for line in lines[header + 1:header + 4]]
    assert [r[0] for r in rows] == ["1", "4", "start"] and all(float(r[-1]) > 0 for r in rows)


@needs_gpt_fast
def test_gpt_fast_runs_lmds_weights():
    import gpt_fast_peer
    from engine import LLAMA2_7B, TINY, build_workspace
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmd.deploy.workspace_reader import reconstruct_hf_state_dict

    gf = gpt_fast_peer.import_gpt_fast(PEERS / "gpt-fast")
    assert gpt_fast_peer.model_args(gf, LLAMA2_7B) == gf.ModelArgs.from_name("7B")
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), TINY, False, 1024, torch.device("cpu"))
        model = gpt_fast_peer.load_model(gf, ws, TINY, "cpu", torch.float32)
        hf = LlamaForCausalLM(LlamaConfig(**TINY, rms_norm_eps=1e-5, max_position_embeddings=1024,
                                          tie_word_embeddings=False)).eval()
        hf.load_state_dict({k: v.float() for k, v in reconstruct_hf_state_dict(ws).items()}, strict=False)
    model.setup_caches(max_batch_size=2, max_seq_length=64)
    ids = torch.randint(3, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(0), dtype=torch.int)
    with torch.no_grad():
        ours, theirs = model(ids, torch.arange(20)), hf(ids.long()).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # greedy decode through the peer's loop continues the prefill the same way (cache positions, masks)
    model.setup_caches(max_batch_size=2, max_seq_length=64)
    _, out = gpt_fast_peer.generate(model, gpt_fast_peer.decode_one_token, ids, 4, "cpu")
    with torch.no_grad():
        ref = hf.generate(ids.long(), max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    assert out.tolist() == ref[:, 20:].tolist()


def test_a_child_that_hangs_is_reported_not_fatal(tmp_path):
    from decode_vs_lmdeploy import run_child

    out = tmp_path / "child.json"
    out.write_text(json.dumps({"rows": {"1": {"decode_ms_mean": 4.0}}}))  # what it wrote before it hung
    result = run_child([sys.executable, "-c", "import time; time.sleep(60)"], out, timeout=1)
    assert result["failed"] == "timed out after 1 s" and result["rows"] == {1: {"decode_ms_mean": 4.0}}
    assert run_child([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "none.json", 30) == {
        "failed": "exit code 3", "child_wall_s": pytest.approx(0, abs=30)}


def test_awq_checkpoint_for_lmdeploy_holds_the_workspace_weights(tmp_path):
    """--weights int4: LMDeploy reads an AutoAWQ gemm checkpoint written from lmd's int4 workspace; read back, its
    weights are the workspace's (the same codes, scales and zeros: AWQ's (q - z) * s against the engine's q * s + z)."""
    import decode_vs_lmdeploy as bench
    from engine import TINY, build_workspace

    from lmd.deploy.workspace_reader import reconstruct_hf_state_dict
    from lmd.lite.awq_export import dequantized_state_dict

    ws = build_workspace(tmp_path / "ws", TINY, True, 256, torch.device("cpu"))
    out = bench.write_awq_checkpoint(ws, tmp_path / "awq", TINY, 256)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                             "version": "gemm"}
    got, want = dequantized_state_dict(out), reconstruct_hf_state_dict(ws)
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.float(), rtol=0, atol=2e-3 * tensor.float().abs().max().item(),
                                   msg=name)
