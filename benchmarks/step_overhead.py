"""A decode step's fixed cost with the norms and rotary embeddings on the C++ kernels against the same engine with
them through torch, side by side in one process (issue 42; not run by CI).

    python benchmarks/step_overhead.py [--model DIR] [--layers 48] [--rounds 9] [--threads 2]

The model defaults to a random Qwen3-MoE of the family's tiny test dimensions with --layers layers (made once under
~/.cache/hybridmoe), whose decode step is almost nothing but per-layer fixed cost: what a real model's 48 or 61
layers pay on top of reading their weights. `--model demo` or a checkpoint directory measures that model instead.
One engine decodes one request; each round times 10 steps with the kernels ("kernels": the engine as it is) and 10
with torch ("torch": kernels.norm.applies and kernels.rope.applies answering False, and RoPE's cos/sin computed
again for every layer, as before the kernels), the order flipping every round. Prints the median ms a step of each
and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory or demo (default: the tiny 48-layer Qwen3-MoE)")
    p.add_argument("--layers", type=int, default=48, help="layers of the default tiny model (default 48)")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    p.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    args = p.parse_args()
    os.environ["HYBRIDMOE_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from hybridmoe.kernels import norm, rope
    from hybridmoe.layers.rope import RotaryEmbedding
    from hybridmoe.runtime.engine import EngineConfig, LLMEngine
    from hybridmoe.runtime.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from hybridmoe.checkpoint.synthetic import save_tiny_model

        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe"
        model = home / f"tiny-qwen3-moe-{args.layers}l"
        if not (model / "config.json").is_file():
            save_tiny_model(model, "qwen3_moe", num_hidden_layers=args.layers)
    kernel_applies = (norm.applies, rope.applies)
    cos_sin = RotaryEmbedding.cos_sin

    def every_layer(self, positions, dtype):  # no reuse within a forward
        self._last = None
        return cos_sin(self, positions, dtype)

    def use(kernels: bool) -> None:
        norm.applies, rope.applies = kernel_applies if kernels else (lambda *a: False, lambda *a: False)
        RotaryEmbedding.cos_sin = cos_sin if kernels else every_layer

    engine = LLMEngine(model, EngineConfig(dtype="float32"), show_progress=False)
    steps = 10
    engine.add_request(list(range(5, 37)), SamplingParams(temperature=0.0, max_tokens=4 + 2 * steps * args.rounds,
                                                          ignore_eos=True))
    for _ in range(4):  # the prefill and a few warm steps
        engine.step()
    times: dict[str, list[float]] = {"kernels": [], "torch": []}
    for r in range(args.rounds):
        for name in (("kernels", "torch") if r % 2 else ("torch", "kernels")):
            use(name == "kernels")
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    use(True)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{model}: ms a decode step, median of {args.rounds} rounds: torch {med['torch']:.2f}, kernels "
          f"{med['kernels']:.2f}, torch / kernels {med['torch'] / med['kernels']:.2f}x")


if __name__ == "__main__":
    main()
