"""One timed greedy decode through an engine: what the benchmarks that compare two variants of the engine,
alternating in one process, time in each round."""

from __future__ import annotations

import time

from hybridmoe.runtime.engine import LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams


def timed_greedy_decode(engine: LLMEngine, prompt: str | list[int], steps: int) -> tuple[float, list[int]]:
    """Decode steps + 1 greedy tokens after prompt (text or ids) -> (tok/s of the steps after the first token,
    the prompt's; all the tokens)."""
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            tokens = out.token_ids
    return (len(tokens) - 1) / (time.perf_counter() - first), tokens
