"""The server in process: uvicorn on a thread, on a loopback port of its own, over a tiny float32 model."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hybridmoe.runtime.async_engine import AsyncLLMEngine
from hybridmoe.runtime.engine import EngineConfig
from hybridmoe.serve.api_server import build_app
from hybridmoe.serve.state import ServerSettings

MODEL_NAME = "tiny"


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine

    def metric(self, name: str, **labels: str) -> float:
        """The value of hybridmoe:NAME{model_name="tiny", **labels} in GET /metrics."""
        wanted = {"model_name": MODEL_NAME, **labels}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == "hybridmoe:" + name and sample.labels == wanted:
                    return sample.value
        raise KeyError(f"hybridmoe:{name}{wanted} is not in /metrics")


@contextlib.contextmanager
def running_server(engine: AsyncLLMEngine, wait_ready: bool = True, **settings):
    """Serve engine on 127.0.0.1 (a free port) until the block ends; settings: ServerSettings fields."""
    app = build_app(engine, ServerSettings(**{"served_model_name": MODEL_NAME, **settings}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while not server.started or (wait_ready and not engine.is_ready):
        assert time.monotonic() < deadline, "the server did not start within 60 s"
        assert thread.is_alive(), "the server thread died"
        time.sleep(0.02)
    try:
        yield RunningServer(url, engine)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def tiny_engine(model_dir, **options) -> AsyncLLMEngine:
    return AsyncLLMEngine(model_dir, EngineConfig(dtype="float32", **options))


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def server(model_dir):
    """A server with default settings over the tiny model, shared by a module's tests."""
    with running_server(tiny_engine(model_dir)) as running:
        yield running
