"""The `lmd serve` command: flag checks before anything loads, and (slow) a real server process on a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.serve.conftest import sse_payloads


def _lmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmd", *args], capture_output=True, text=True, timeout=120)


def test_help_explains_the_flags() -> None:
    result = _lmd("serve", "--help")
    assert result.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--model-name",
        "--api-keys",
        "--max-batch-size",
        "--cache-max-entry-count",
        "--quant-policy",
        "--session-len",
        "--log-level",
        "--reasoning-parser",
    ):
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port", "70000"], "--port 70000"),
        (["--server-port", "70000"], "--port 70000"),
        (["--log-level", "loud"], "--log-level loud"),
        (["--chat-template", "qwen"], "--chat-template"),
        (["--otlp-traces-endpoint", "collector:4318"], "--otlp-traces-endpoint"),
        (["--reasoning-parser", "o1"], "--reasoning-parser o1 is unknown; use one of deepseek_r1, qwen3"),
    ],
)
def test_bad_flags_fail_in_one_line(serve_ws, flags, words) -> None:
    result = _lmd("serve", str(serve_ws), *flags)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("lmd: ") and words in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("command", ["serve", "gradio"])
def test_servers_take_vllm_and_lmdeploy_address_flags(serve_ws, command) -> None:
    """--host/--port (vLLM) and --server-name/--server-port (LMDeploy) on both servers; checked before any load."""
    help_text = _lmd(command, "--help").stdout
    assert all(flag in help_text for flag in ("--host", "--port", "--server-name", "--server-port"))
    for host, port in (("--host", "--port"), ("--server-name", "--server-port")):
        result = _lmd(command, str(serve_ws), host, "127.0.0.1", port, "0")
        assert result.returncode == 1 and result.stderr.startswith("lmd: --port 0 is not a TCP port"), result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_real_server_process(serve_ws) -> None:
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "lmd",
        "serve",
        str(serve_ws),
        "--server-name",  # LMDeploy's spelling of --host / --port
        "127.0.0.1",
        "--server-port",
        str(port),
        "--model-name",
        "tiny",
        "--device",
        "cpu",
        "--cache-max-entry-count",
        "64",
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "LMD_API_KEYS": "sekrit"}
    )
    stopping = False
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekrit"}
    try:
        deadline = time.monotonic() + 240  # start-up takes ~8 s on 2 loaded cores; a stuck one fails clearly
        while True:  # wait for the port to answer (or the process to die)
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "lmd serve did not answer /health within 240 s"
            time.sleep(0.1)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 401
        whole = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=30).json()
        assert whole["usage"]["completion_tokens"] == 5
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=30
        ) as response:
            payloads = sse_payloads(response.read().decode())
        assert payloads[-1] == "[DONE]"
        text = "".join(json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-1])
        assert text == whole["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'lmd_requests_finished_total{endpoint="/v1/chat/completions",finish_reason="length"} 2' in metrics
        # Ctrl+C while a long answer streams: the stream ends at once with "abort" and [DONE], the server exits 0
        long = {**body, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=long, headers=auth, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGINT)
            stopping = True
            payloads = sse_payloads("\n".join(lines))
        assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort"
    finally:
        if server.poll() is None and not stopping:  # a second Ctrl+C would force the exit
            server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr and "lmd serve" in stderr  # the startup table
    assert "decode steps" in stderr and "eager" in stderr  # CPU: no CUDA graphs
