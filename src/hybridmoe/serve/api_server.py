"""The FastAPI application and its uvicorn server: routes, the API-key and body-size guard, startup and graceful
shutdown.

`build_app(engine, settings)` -> the ASGI app (the engine is started by the app's lifespan and loads in the
background: /health says 503 until it is ready, generation routes 503 with Retry-After). `run_server(...)` serves it
until SIGTERM or SIGINT: it stops accepting connections, lets the requests in flight finish (for at most
shutdown_timeout seconds, then aborts them), stops the engine and returns 0; 1 when the model failed to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time

import uvicorn
from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridmoe import __version__
from hybridmoe.serve.chat import create_chat_completion, render_messages
from hybridmoe.serve.completions import create_completion
from hybridmoe.serve.engine_client import EngineClient
from hybridmoe.serve.errors import APIError, error_body, install_error_handlers
from hybridmoe.serve.metrics import CONTENT_TYPE
from hybridmoe.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from hybridmoe.serve.state import ServerSettings, ServerState

log = logging.getLogger("hybridmoe.serve")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # what the API key guards (not /health, /metrics)


# Routes are module-level and find their ServerState on request.app.state: FastAPI caches route functions in
# process-wide LRU caches, and routes closing over the state kept every app's engine (and its KV cache) alive.
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _ready(request: Request, model: str | None) -> ServerState:
    """The state, once `model` (if named) is the one served and it is loaded; else the 404 or 503."""
    state = _state(request)
    state.check_model(model)
    state.check_ready()
    return state


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(_state(request), body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(_state(request), body, request)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    state.check_ready()
    return JSONResponse({"object": "list", "data": [{
        "id": state.settings.served_model_name, "object": "model", "created": int(state.created),
        "owned_by": "hybridmoe", "max_model_len": state.engine.max_model_len}]})


@router.get("/health")
async def health(request: Request) -> Response:
    engine = _state(request).engine
    if engine.is_ready:
        return Response(status_code=200)
    return APIError(503, "the model is still loading" if engine.load_error is None else
                    f"the model failed to load: {engine.load_error}", retry_after=1).response()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = _ready(request, body.model)
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        ids = render_messages(tokenizer, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    result = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = [state.token_strings(t) for t in ids]
    return JSONResponse(result)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    tokenizer = _ready(request, body.model).engine.tokenizer
    bad = [t for t in body.tokens if t >= tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size}): got {bad[:5]}", param="tokens")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})


def build_app(engine: EngineClient, settings: ServerSettings, on_load_failed=None) -> FastAPI:
    """The app serving engine (started, and shut down, by the app's lifespan). on_load_failed() is called when the
    model fails to load."""
    state = ServerState(engine, settings)
    engine.on_request_finished = state.metrics.on_request_finished

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.create_task(_report_loading(engine, on_load_failed))
        yield
        watcher.cancel()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="hybridmoe", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(_Guard, settings=settings)
    return app


async def _report_loading(engine: EngineClient, on_load_failed) -> None:
    started = time.monotonic()
    try:
        await engine.wait_ready()
    except Exception as error:
        log.error("%s", error)
        if on_load_failed is not None:
            on_load_failed()
        return
    log.info("model loaded in %.1f s; max_model_len %d", time.monotonic() - started, engine.max_model_len)


class _Guard:
    """Pure ASGI, in front of the app: the API key (401, compared in constant time) and the body size (413, the
    declared Content-Length or the bytes actually sent). Passes everything else through untouched, streaming
    responses and disconnect messages included."""

    def __init__(self, app: FastAPI, settings: ServerSettings):
        self.app, self.settings = app, settings
        self._expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._expected is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                return await _send(send, APIError(401, "missing or wrong API key: send the header "
                                                       "'Authorization: Bearer KEY'", code="invalid_api_key"),
                                   {b"www-authenticate": b"Bearer"})
        limit = self.settings.max_request_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _send(send, APIError(400, "the Content-Length header is not a number"))
        if declared > limit:
            return await _send(send, too_large)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = bytearray(), True
            while more:  # read it all here: a body sent without a length is counted as it arrives
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    return await _send(send, too_large)
            receive = _replay(bytes(body), receive)
        await self.app(scope, receive, send)


def _replay(body: bytes, receive):
    """A receive that gives the buffered body once, then waits on the connection (for its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _send(send, error: APIError, extra_headers: dict | None = None) -> None:
    payload = json.dumps(error_body(error.status, error.message, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += list((extra_headers or {}).items())
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def run_server(engine: EngineClient, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
               shutdown_timeout: float = 30.0, log_level: str = "info") -> int:
    """Serve until SIGTERM / SIGINT, then shut down gracefully; 0, or 1 when the model failed to load."""
    failed = []
    server: uvicorn.Server | None = None

    def load_failed():
        failed.append(True)
        server.should_exit = True

    app = build_app(engine, settings, on_load_failed=load_failed)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down, with the handlers that were there before
    # it started: handlers that do nothing make that a plain return, so a graceful stop exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed or not server.started else 0
