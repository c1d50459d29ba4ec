"""benchmarks/data_parallel.py --tiny on CPU: two replicas, each a serving_workloads.py process serving every
other request, and their aggregate; a replica that fails is reported, not hidden."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
REQUESTS = [(20 + 3 * i, 5 + i % 7) for i in range(12)]  # (prompt, output) tokens: outputs under tiny's clip of 12


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("data_parallel"), importlib.import_module("serving_workloads")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def lengths(tmp_path) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"requests": REQUESTS, "conversations": [[10, 5]] * 6, "source": {}}))
    return path


def test_two_tiny_replicas_share_the_requests(scripts, lengths, tmp_path, monkeypatch, capsys):
    data_parallel, _ = scripts
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = data_parallel.main(["--tiny", "--lengths", str(lengths), "--out", str(tmp_path)])
    runs, total = results["replicas_runs"], results["aggregate"]
    assert [r["requests"] for r in runs] == [6, 6]
    for index, run in enumerate(runs):  # every other request, as a round-robin balancer deals them
        assert run["output_tokens"] == sum(o for _, o in REQUESTS[index::2])
        assert (tmp_path / f"replica_{index}" / "serving_workloads.json").exists()
    assert total["requests"] == 12 and total["output_tokens"] == sum(o for _, o in REQUESTS)
    assert total["total_s"] == max(r["total_s"] for r in runs)
    assert total["output_tokens_per_s"] == pytest.approx(total["output_tokens"] / total["total_s"])
    assert json.loads((tmp_path / "data_parallel.json").read_text())["aggregate"] == total
    assert capsys.readouterr().out.rstrip().endswith("┘")  # the table comes last


def test_a_failed_replica_fails_the_aggregate(scripts, lengths, tmp_path):
    data_parallel, _ = scripts
    results = data_parallel.main(["--tiny", "--lengths", str(lengths), "--out", str(tmp_path), "--num-requests",
                                  "50"])  # more than the lengths hold: every replica exits with that error
    assert all("no serving_workloads.json" in r["failed"] for r in results["replicas_runs"])
    assert results["aggregate"] == {"failed": "2 of 2 replicas did not finish"}
    assert "holds 12 requests" in (tmp_path / "replica_0" / "log.txt").read_text()


def test_shard_flags(scripts):
    _, serving = scripts
    assert serving.parse_args(["--shard", "1/4", "--no-peer"]).shard == (1, 4)
    for bad in ("4/4", "-1/2", "x", "1/2/3"):
        with pytest.raises(SystemExit):
            serving.parse_args(["--shard", bad, "--no-peer"])
    with pytest.raises(SystemExit, match="--no-peer"):
        serving.parse_args(["--shard", "0/2"])
