"""Ranks started by torchrun: two `torchrun --nnodes 2 --node-rank r` launches on localhost serve one model split
over both (rank 0 serves HTTP), with the replies of one process; a killed rank stops rank 0 with one line naming it;
a rank that never joins is named within LMD_JOIN_TIMEOUT; the launcher's variables are checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmd.errors import LmdError
from lmd.turbomind.torchrun_env import check_world, torchrun_env
from lmd.turbomind.tp_group import free_port

PROMPTS = [[5, 900, 31, 7, 4000, 12, 77], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]]


@pytest.fixture(scope="module")
def ws3(tmp_path_factory) -> Path:
    from tests.conftest import deploy_tiny

    return deploy_tiny(tmp_path_factory.mktemp("torchrun"), "llama", model_name="hf", num_hidden_layers=3)[1]


def test_the_launchers_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(LmdError, match="incomplete"):
        torchrun_env()
    for name, value in (("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "node0"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    env = torchrun_env()
    assert (env.rank, env.world, env.local_rank, env.node, env.master_addr, env.master_port) == (3, 4, 1, 1, "node0",
                                                                                                 29500)
    with pytest.raises(LmdError, match=r"torchrun started 4 processes but --tp 2 x --pp 1 needs 2"):
        check_world(env, 2, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_env() is None  # one process: nothing to join


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a torchrun launch exited before the server was up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the server did not come up")


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), deepest first."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parent_of.items() if parent in frontier]
        found = kids + found
        frontier = kids
    return found


def _greedy_alone(ws: Path) -> list[list[int]]:
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.gen_config import GenerationConfig

    with Engine(ws, device="cpu", cache_max_entry_count=64) as engine:
        config = GenerationConfig(max_new_tokens=8, temperature=0, ignore_eos=True)
        return [engine.generate(p, config).result().token_ids for p in PROMPTS]


def test_two_nodes_serve_the_replies_of_one_process_and_a_killed_rank_stops_both(ws3, tmp_path):
    expected = _greedy_alone(ws3)
    master, http = free_port(), free_port()
    procs, logs = [], []
    for node in (0, 1):
        log = (tmp_path / f"node{node}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
             "-m", "lmd", "serve", str(ws3), "--pp", "2", "--device", "cpu", "--port", str(http),
             "--cache-max-entry-count", "64"],
            stdout=log, stderr=subprocess.STDOUT,
            # a collective that waits on the killed rank ends within 30 s even when its closed connection is missed
            env=_env(LMD_JOIN_TIMEOUT="120", LMD_TP_TIMEOUT="30")))
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_healthy(url, procs)
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            reply = _post(url + "/v1/completions", dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True,
                                                        return_token_ids=True))
            assert reply["choices"][0]["token_ids"] == tokens
        for pid in _children(procs[1].pid):  # node 1's rank (torchrun starts it in a session of its own)
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(urllib.error.HTTPError):
            _post(url + "/v1/completions", dict(prompt=PROMPTS[0], max_tokens=4, temperature=0))
        assert procs[0].wait(timeout=60) != 0  # rank 0 stops too
        assert procs[1].wait(timeout=60) != 0  # node 1's torchrun reports its rank's death
        text = (tmp_path / "node0.log").read_text()
        assert "lmd: model-parallel rank 1 (node 1, " in text and "stopped; the other ranks exit" in text
    finally:
        for proc in procs:
            if proc.poll() is None:
                for pid in [*_children(proc.pid), proc.pid]:
                    os.kill(pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for log in logs:
            log.close()


def test_a_rank_that_never_joins_is_named(ws3):
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), LMD_JOIN_TIMEOUT="3")
    run = subprocess.run([sys.executable, "-m", "lmd", "serve", str(ws3), "--tp", "2", "--device", "cpu",
                          "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode != 0
    assert "rank 1 (node 1) did not join within 3 s" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
