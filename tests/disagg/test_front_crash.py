"""`hybridmoe serve --pd` killed outright (SIGKILL: no shutdown runs): its workers notice their socket closing,
remove the shared-memory segments under the server's prefix (a KV payload on its way, the weights they share: a
bf16 checkpoint computed in float32) and exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from hybridmoe.disagg.shm import list_segments, owner_prefix, shm_dir

pytestmark = pytest.mark.slow
HANG_S = 120


def _children(pid: int) -> list[int]:
    """pid's child processes (each thread's: the workers are started from the front's watcher threads)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(x) for x in f.read().split()]
    return children


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_clean_up_and_exit_when_the_server_is_killed(tiny_model_dir):
    model_dir = str(tiny_model_dir("qwen3_moe", dtype=torch.bfloat16))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "hybridmoe.cli", "serve", "--pd", "--model",
                               model_dir, "--dtype", "float32", "--kv-cache-gb", "0.05",
                               "--port", str(port), "--log-level", "warning"])
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not get ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": model_dir, "prompt": [5, 6, 7], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        workers = _children(server.pid)
        assert len(workers) == 2
        # a payload on its way when the server dies (written here, named as the server's workers name theirs)
        left = shm_dir() / f"{owner_prefix(server.pid)}{workers[0]}-99"
        left.write_bytes(b"\0" * 4096)
        assert any(p.name.startswith(owner_prefix(server.pid) + "weights-")
                   for p in list_segments(owner_prefix(server.pid)))
        os.kill(server.pid, signal.SIGKILL)
        server.wait(HANG_S)
        deadline = time.monotonic() + HANG_S
        while not all(_gone(w) for w in workers):
            assert time.monotonic() < deadline, "the workers outlived their server"
            time.sleep(0.05)
        assert not left.exists() and list_segments(owner_prefix(server.pid)) == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
