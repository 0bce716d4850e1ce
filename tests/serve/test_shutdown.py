"""`hybridmoe serve` as a process: SIGTERM while a request streams lets it finish and exits 0; a model whose config
reads but whose weights fail to load exits 1, after /health said why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridmoe.cli", "serve", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_sigterm_finishes_the_streaming_request_and_exits_0(model_dir):
    port = _free_port()
    process = _serve("--model", str(model_dir), "--dtype", "float32", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not become healthy within 60 s"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        body = {"prompt": [5, 17, 33], "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"  # finished, not aborted
        assert process.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_model_that_fails_to_load_exits_1(model_dir, tmp_path):
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")  # no weights, no tokenizer
    process = _serve("--model", str(tmp_path), "--port", str(_free_port()))
    try:
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "the model failed to load" in process.stdout.read()
