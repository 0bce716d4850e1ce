"""Routing statistics of a model on sample prompts (`hybridmoe profile --routing-model`): which experts each MoE
layer picks, for the planner's hot experts."""

from __future__ import annotations

SAMPLE_PROMPTS = (
    "Explain how a mixture-of-experts language model decides which experts process each token.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "Write a short letter to a neighbour about the noise from the garden party last weekend.",
    "Translate into French: the train leaves at seven, so we should be at the station by half past six.",
    "List the planets of the solar system with one fact about each.",
)


def measure_routing(model_dir: str, prompts: list[str]):
    """Prefill `prompts` through the engine and count each MoE layer's top-k expert choices."""
    import numpy as np

    from hybridmoe.placement.routing import RoutingStats
    from hybridmoe.runtime.llm import LLM
    from hybridmoe.runtime.sampling_params import SamplingParams

    llm = LLM(model_dir)
    chosen: dict[int, list] = {}
    llm.engine.model.add_routing_observer(
        lambda index, ids: chosen.setdefault(index, []).append(ids.cpu().numpy()))  # ids [T, K]
    llm.generate(prompts, SamplingParams(max_tokens=1))
    ids = {index: np.concatenate(parts) for index, parts in chosen.items()}
    return RoutingStats.from_topk_ids(ids, llm.engine.model_config.moe.num_experts)
