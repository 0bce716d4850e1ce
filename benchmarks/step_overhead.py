"""A decode step's fixed cost with its layers in one native call (the decode stack), with each of their kernels called
from Python, and with the norms and rotary embeddings through torch, side by side in one process (issue 42; not run
by CI).

    python benchmarks/step_overhead.py [--model DIR] [--layers 48] [--rounds 9] [--threads 2]
                                       [--variants stack,kernels,torch] [--dtype float32]

The model defaults to a random Qwen3-MoE of the family's tiny test dimensions with --layers layers (made once under
~/.cache/hybridmoe), whose decode step is almost nothing but per-layer fixed cost: what a real model's 48 or 61
layers pay on top of reading their weights. `--model demo` or a checkpoint directory measures that model instead.
One engine decodes one request; each round times 10 steps of each variant, the order rotating every round:
"stack" (the engine as it is: models.decode_stack), "kernels" (the stack off: each layer's kernel calls from Python)
and "torch" (the stack off, kernels.norm.applies and kernels.rope.applies answering False, and RoPE's cos/sin
computed again for every layer, as before the kernels); --variants picks some of them. Prints the median ms a step
of each and the ratios of neighbours in that list.
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
    p.add_argument("--variants", default="stack,kernels,torch", help="which to time (default stack,kernels,torch)")
    p.add_argument("--dtype", default="float32", help="the engine's compute dtype (default float32; auto: the model's)")
    args = p.parse_args()
    variants = args.variants.split(",")
    if any(v not in ("stack", "kernels", "torch") for v in variants) or len(set(variants)) < len(variants):
        raise SystemExit(f"--variants: some of stack, kernels, torch, each once; got {args.variants!r}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be positive")
    os.environ["HYBRIDMOE_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from hybridmoe.kernels import norm, rope
    from hybridmoe.layers.rope import RotaryEmbedding
    from hybridmoe.models import decode_stack
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

    def use(variant: str) -> None:
        kernels = variant != "torch"
        norm.applies, rope.applies = kernel_applies if kernels else (lambda *a: False, lambda *a: False)
        RotaryEmbedding.cos_sin = cos_sin if kernels else every_layer
        decode_stack.ENABLED = variant == "stack"

    engine = LLMEngine(model, EngineConfig(dtype=args.dtype), show_progress=False)
    steps = 10
    engine.add_request(list(range(5, 37)), SamplingParams(temperature=0.0,
                                                          max_tokens=4 + len(variants) * steps * args.rounds,
                                                          ignore_eos=True))
    for _ in range(4):  # the prefill and a few warm steps
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in variants[r % len(variants):] + variants[:r % len(variants)]:
            use(name)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    use("stack")
    med = {name: statistics.median(v) for name, v in times.items()}
    ratios = [f"{a} / {b} {med[a] / med[b]:.2f}x" for a, b in zip(variants[::-1], variants[::-1][1:])]
    print(f"{model}: ms a decode step, median of {args.rounds} rounds: "
          + ", ".join(f"{name} {med[name]:.2f}" for name in variants) + "".join(", " + r for r in ratios))


if __name__ == "__main__":
    main()
