"""What attention importance costs the prefill: `serve --pd --kv-budget B` (B < 1, `--kv-importance attention`)
scores each prompt in the prefill worker's engine (`LLMEngine.set_prompt_importance`, kv/importance.py).

One engine, one prompt prefilled to its first token (max_tokens 1), alternating rounds with the scoring off and on
(the same engine and cache; prefix caching off, so every round computes the whole prompt). Reports the median
time of each, the ratio, and the time spent inside the observer itself (the scoring alone, free of the noise of
two whole prefills).

    python benchmarks/prompt_importance.py [--model demo] [--tokens 2000] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hybridmoe.commands._kv_eval import reference_text
from hybridmoe.kv.importance import AttentionImportance
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams


def prefill_s(engine: LLMEngine, ids: list[int], req_id: str) -> float:
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), req_id=req_id)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = LLMEngine(args.model, EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=args.tokens),
                       show_progress=False)
    ids = engine.tokenizer.encode(reference_text())[: args.tokens]
    times: dict[str, list[float]] = {"off": [], "on": []}
    inside = [0.0]
    observe = AttentionImportance.__call__

    def timed(self, *a):
        start = time.perf_counter()
        observe(self, *a)
        inside[0] += time.perf_counter() - start

    AttentionImportance.__call__ = timed
    prefill_s(engine, ids, "warm-up")
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            engine.set_prompt_importance(mode == "on")
            times[mode].append(prefill_s(engine, ids, f"{mode}-{r}"))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    observer_s = inside[0] / args.rounds
    result = {"model": str(args.model), "tokens": len(ids), "rounds": args.rounds, "off_s": times["off"],
              "on_s": times["on"], "median_off_s": round(off, 4), "median_on_s": round(on, 4),
              "overhead_pct": round(100 * (on / off - 1), 2), "observer_s_per_prefill": round(observer_s, 4),
              "observer_pct_of_prefill": round(100 * observer_s / off, 2),
              "paired_overhead_pct": [round(100 * (b / a - 1), 2) for a, b in zip(times["off"], times["on"])]}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
