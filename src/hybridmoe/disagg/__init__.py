"""Prefill/decode disaggregation on one machine (docs/serving.md, "Prefill/decode disaggregation").

A prefill worker process and a decode worker process, each with its own `LLMEngine` (its own accelerator context on
CUDA), both mapping the same checkpoint pages, under one front that the server talks to as an `EngineClient`.
New prompts go to the prefill worker; once a prompt's KV is complete and its first token sampled, the request
moves to the decode worker with its KV, packed as a SpectrumKV payload (kv/payload.py) in a shared-memory segment.

Modules: `shm` (named shared-memory segments under one owner's prefix, swept on exit), `cpus` (the CPUs each
worker is pinned to), `handoff` (a request's
KV out of one engine's paged cache into a payload, and from a payload into another's), `messages` (what the front
and the workers say over their sockets), `worker` (a worker process's main loop), `engine` (`PDEngine`, the front:
spawns and watches the workers, routes requests, restarts a worker that died).
"""

__all__ = ["PDEngine"]


def __getattr__(name: str):
    # lazily: the worker runs as `python -m hybridmoe.disagg.worker`, which must not be imported by the package first
    if name == "PDEngine":
        from hybridmoe.disagg.engine import PDEngine

        return PDEngine
    raise AttributeError(f"module 'hybridmoe.disagg' has no attribute {name!r}")
