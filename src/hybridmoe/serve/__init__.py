"""The OpenAI-compatible HTTP server (`hybridmoe serve`): FastAPI + uvicorn over an `EngineClient` (the runtime's
AsyncLLMEngine). No torch and no model code here; only the runtime's public API. See docs/serving.md."""
