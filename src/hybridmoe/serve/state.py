"""`ServerSettings` (the server's own options) and `ServerState` (what every handler shares: the engine, the
settings, the metrics), with the admission checks every generation request passes first."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hybridmoe.serve.engine_client import EngineClient
from hybridmoe.serve.errors import APIError
from hybridmoe.serve.logprobs import TokenStrings
from hybridmoe.serve.metrics import ServerMetrics

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/*, /tokenize and /detokenize need "Authorization: Bearer KEY"
    max_waiting_requests: int = 1024  # requests accepted but not running yet, past which new ones get 429
    max_request_bytes: int = 16 * 2**20  # bodies past this get 413


class ServerState:
    def __init__(self, engine: EngineClient, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.metrics = ServerMetrics(settings.served_model_name, engine.stats,
                                     lambda: getattr(getattr(engine, "engine", None), "run_stats", None))
        self._strings: TokenStrings | None = None
        self.created = time.time()

    @property
    def token_strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.tokenizer)
        return self._strings

    def check_model(self, model: str | None) -> None:
        """404 unless model is None or the served name."""
        if model is not None and model != self.settings.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.settings.served_model_name}`.", param="model", code="model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_ready:
            loading = self.engine.load_error is None
            raise APIError(503, "the model is still loading" if loading else "the model is not available",
                           retry_after=RETRY_AFTER_S if loading else None)

    def admit(self, model: str | None, num_requests: int) -> None:
        """Checks before a generation: the model name (404), loaded (503), the waiting queue's bound (429)."""
        self.check_model(model)
        self.check_ready()
        stats = self.engine.stats()
        running = stats.num_running_requests if stats is not None else 0
        waiting = max(0, self.engine.num_unfinished_requests - running)
        if waiting + num_requests > self.settings.max_waiting_requests:
            raise APIError(429, f"the server is busy: {waiting} requests are waiting (at most "
                                f"{self.settings.max_waiting_requests}); retry later",
                           code="queue_full", retry_after=RETRY_AFTER_S)
