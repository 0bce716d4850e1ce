"""The server `bench serve` talks to: a URL on this machine (`check_loopback`), or `hybridmoe serve` started as a
subprocess on 127.0.0.1 (`ServerProcess`), so that the load generator and the server are always two processes.

Loopback only: the bench sends as many requests as it is told to, as fast as it is told to, which against a
shared or remote service would be a load test nobody agreed to; and latencies over a network would measure the
network too.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

HEALTH_POLL_S = 0.25
STOP_GRACE_S = 15.0  # between SIGTERM and SIGKILL: a server finishes or aborts its requests and exits
LOG_TAIL_LINES = 30


class ServerError(RuntimeError):
    """The server did not start, or died."""


def check_loopback(url: str) -> str:
    """`url` without a trailing slash, if it is http(s) on a loopback host (localhost, 127.0.0.0/8, ::1); else
    ValueError saying why."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"--url must be http://HOST:PORT of a server on this machine, got {url!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        loopback = False
    if not loopback:
        raise ValueError(f"--url host {host!r} is not this machine: bench serve only loads a server on a loopback "
                         f"address (localhost, 127.0.0.0/8, ::1), because it sends as much load as it is told to "
                         f"and its latencies would include a network")
    return url.rstrip("/")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice; another process could take it before the server
    binds it, which the server's start would then report)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`hybridmoe serve --model MODEL --host 127.0.0.1 --port FREE [server_args]` in a subprocess, ready once
    GET /health answers 200 (503 while the model loads); stopped by SIGTERM, then SIGKILL after STOP_GRACE_S.
    Its output goes to `log_path` (default: a temporary file, removed once it stops), whose last lines any
    error quotes."""

    def __init__(self, model: str, server_args: list[str] = (), startup_timeout_s: float = 600.0,
                 log_path: str | Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "hybridmoe.cli", "serve", "--model", model, "--host", "127.0.0.1",
                        "--port", str(self.port), *server_args]
        self.startup_timeout_s = startup_timeout_s
        self.keep_log = log_path is not None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="hybridmoe-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:  # a file, not a pipe: nobody reads a pipe while the bench runs
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise ServerError(f"the server exited with status {self.process.returncode} before it was "
                                      f"ready ({' '.join(self.command)}); its last lines:\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:  # not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"the server was not ready (GET /health 200) within "
                                      f"{self.startup_timeout_s:g} s; its last lines:\n{self.log_tail()}")
                time.sleep(HEALTH_POLL_S)

    def died(self) -> str | None:
        """Why the server is gone (its status and last lines), None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        return f"the server exited with status {self.process.returncode}; its last lines:\n{self.log_tail()}"

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-LOG_TAIL_LINES:]) or "(no output)"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)
