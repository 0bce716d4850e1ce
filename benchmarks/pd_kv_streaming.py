"""What streaming the prompt's KV layer by layer buys in `serve --pd`: two PDEngines, one sending each layer as
the prefill computes it (the default) and one packing the KV after the prefill (`--no-kv-streaming`), side by side
in one run, on the demo model (or --model).

Per round and engine: one request with a --long-tokens prompt (a prompt of its own each time: no prefix-cache hit)
and 3 greedy output tokens, nothing else running. Reported per engine: its TTFT (the prefill worker's first token,
which with streaming includes writing the layers into the segment during the forward) and the handoff gap (its
second token's time minus its first's: packing, when not streamed, the move to the decode worker, unpacking what
is not unpacked yet, and one decode step), and the KV payload's size. Rounds alternate the two engines, both loaded
for the whole run (workers pinned as --split says); figures are medians.

    python benchmarks/pd_kv_streaming.py [--model demo] [--long-tokens 3000] [--rounds 5] [--dtype auto]
                                         [--split auto|PREFILL_CPUS:DECODE_CPUS|none] [--json PATH]

--split auto gives the prefill worker the first half of this process's CPUs and the decode worker the rest, so
that the decode worker's unpacking can overlap the prefill (on the 2-vCPU stand-in one core each).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: idle engines must not spin

from hybridmoe import SamplingParams  # noqa: E402
from hybridmoe.checkpoint.default_model import resolve_model_dir  # noqa: E402
from hybridmoe.config import load_config  # noqa: E402
from hybridmoe.disagg.cpus import split_cpus  # noqa: E402
from hybridmoe.disagg.engine import PDEngine  # noqa: E402
from hybridmoe.kv.layout import KVLayout  # noqa: E402
from hybridmoe.models.loader import resolve_dtype  # noqa: E402
from hybridmoe.runtime.engine import EngineConfig  # noqa: E402

ENGINES = {"streamed": True, "packed after": False}
_SALT = itertools.count(1)


async def measure(engine: PDEngine, args, vocab: int) -> dict:
    salt = next(_SALT)
    prompt = [(j * 17 + salt * 101 + 3) % (vocab - 10) + 5 for j in range(args.long_tokens)]
    stamps = []
    start = time.perf_counter()
    async for out in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
        stamps += [time.perf_counter()] * len(out.new_token_ids)
    return {"ttft_s": stamps[0] - start, "gap_s": stamps[1] - stamps[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--split", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = EngineConfig(dtype=args.dtype, max_num_batched_tokens=args.long_tokens, kv_cache_gb=0.5,
                          max_model_len=args.long_tokens + 16)
    split = split_cpus(args.split, 0.5)
    cpus = {"prefill_cpus": split[0], "decode_cpus": split[1]} if split else {}
    if split:
        print(f"prefill workers on CPUs {split[0]}, decode workers on {split[1]}")
    engines = {name: PDEngine(args.model, config, kv_streaming=on, **cpus) for name, on in ENGINES.items()}
    model_config = load_config(resolve_model_dir(args.model))
    layout = KVLayout.from_config(model_config)
    payload_mb = layout.full_bytes(args.long_tokens, resolve_dtype(args.dtype).itemsize) / 1e6

    async def run() -> dict:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            await engine.wait_ready()
        rounds = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                result = await measure(engines[name], args, model_config.vocab_size)
                rounds[name].append(result)
                print(f"round {r} {name:12s}: TTFT {result['ttft_s'] * 1e3:8.1f} ms, first-to-second token "
                      f"{result['gap_s'] * 1e3:7.1f} ms", flush=True)
        return rounds

    try:
        rounds = asyncio.run(run())
    finally:
        for engine in engines.values():
            engine.shutdown()
    for name, engine in engines.items():
        if (engine.kv_streams > 0) != ENGINES[name]:
            raise SystemExit(f"{name}: {engine.kv_streams} streamed handoffs; the setting did not take")
    summary = {name: {"ttft_ms": statistics.median(x["ttft_s"] for x in results) * 1e3,
                      "gap_ms": statistics.median(x["gap_s"] for x in results) * 1e3}
               for name, results in rounds.items()}
    print(f"\n{'engine':12s} {'TTFT':>10s} {'1st->2nd token':>15s}")
    for name, s in summary.items():
        print(f"{name:12s} {s['ttft_ms']:8.1f}ms {s['gap_ms']:13.1f}ms")
    print(f"(medians of {args.rounds} rounds; {args.long_tokens}-token prompt, KV payload {payload_mb:.1f} MB "
          f"({layout.num_layers} layers); streamed/packed-after: TTFT "
          f"{summary['streamed']['ttft_ms'] / summary['packed after']['ttft_ms']:.2f}x, first-to-second token "
          f"{summary['streamed']['gap_ms'] / summary['packed after']['gap_ms']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0], "payload_mb": payload_mb, "summary": summary,
                       "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
