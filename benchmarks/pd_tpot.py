"""Decode TPOT of the other users while one long prompt prefills: one engine against prefill/decode
disaggregation (`serve --pd`'s PDEngine), its workers on all CPUs and on CPUs of their own (`--split`), side by
side in one run, on the demo model (or --model).

Per round and engine: --users requests with short prompts decode (greedy, EOS ignored); once each has produced a
few tokens, a window of --window-s seconds measures their time per output token undisturbed, then one request
with a --long-tokens prompt arrives and the same users' time per output token is measured from just before it
arrives until its first token (its prefill): each user's (time of its first token after the prefill - time of its
last token before it) / tokens in between, so a stall counts in full. Reported per engine: the users' mean
TPOT without and during the prefill, the rise (during / without - 1; the seed's goal < 15%, ours < 10%), and the
long prompt's TTFT. Rounds alternate the two engines, both loaded for the whole run; figures are medians.

    python benchmarks/pd_tpot.py [--model demo] [--users 4] [--long-tokens 2000] [--rounds 3] [--json PATH]
                                 [--split auto|PREFILL_CPUS:DECODE_CPUS|none]

--split auto (the default) gives the prefill worker the first quarter of this process's CPUs (at least one) and
the decode worker the rest ("pd-split"); none leaves it out.

On the 2-vCPU stand-in the two PD workers share the same two cores: the decode worker no longer waits behind
the prefill step (no head-of-line blocking), but the prefill's compute takes the cores it decodes on. On a GPU
machine each worker has its own CUDA context and streams on the GPU, and the CPU experts' cores are shared.
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
from hybridmoe.disagg.cpus import split_cpus  # noqa: E402
from hybridmoe.disagg.engine import PDEngine  # noqa: E402
from hybridmoe.runtime.async_engine import AsyncLLMEngine  # noqa: E402
from hybridmoe.runtime.engine import EngineConfig  # noqa: E402

WARM_TOKENS = 4
_SALT = itertools.count(1)


async def measure(engine, args, vocab: int) -> dict:
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(args.users)]  # per user: (time, tokens so far)
    stop = asyncio.Event()

    async def user(i: int) -> None:
        prompt = [(i * 131 + j * 7 + next(_SALT)) % (vocab - 10) + 5 for j in range(args.user_prompt_tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=args.user_max_tokens, ignore_eos=True)
        count = 0
        async for out in engine.generate(prompt, params):
            count += len(out.new_token_ids)
            stamps[i].append((time.perf_counter(), count))
            if stop.is_set():
                break  # aborts the request

    tasks = [asyncio.create_task(user(i)) for i in range(args.users)]
    while min(len(s) for s in stamps) < WARM_TOKENS:
        await asyncio.sleep(0.01)
    quiet_start = time.perf_counter()
    await asyncio.sleep(args.window_s)
    long_start = time.perf_counter()
    salt = next(_SALT)  # a prompt of its own each time: no prefix-cache hit on an earlier round's
    long_prompt = [(j * 17 + salt * 101 + 3) % (vocab - 10) + 5 for j in range(args.long_tokens)]
    async for out in engine.generate(long_prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)):
        pass
    long_end = time.perf_counter()
    await asyncio.sleep(0.2)  # every user's first token after the prefill
    stop.set()
    await asyncio.gather(*tasks)
    if any(s[-1][1] >= args.user_max_tokens for s in stamps):
        raise SystemExit("a user finished during the measurement: raise --user-max-tokens")
    return {"tpot_quiet_s": statistics.mean(_tpot(s, quiet_start, long_start) for s in stamps),
            "tpot_prefill_s": statistics.mean(_tpot(s, long_start, long_end) for s in stamps),
            "long_ttft_s": long_end - long_start}


def _tpot(stamps: list[tuple[float, int]], start: float, end: float) -> float:
    """Time per token from the user's last token at or before start to its first token at or after end."""
    before = max((s for s in stamps if s[0] <= start), key=lambda s: s[0])
    after = min((s for s in stamps if s[0] >= end), key=lambda s: s[0])
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--user-prompt-tokens", type=int, default=32)
    parser.add_argument("--user-max-tokens", type=int, default=3000)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--split", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = EngineConfig(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gb=0.5)
    engines = {"single": AsyncLLMEngine(args.model, config), "pd": PDEngine(args.model, config)}
    split = split_cpus(args.split, 0.25)
    if split is not None:
        engines["pd-split"] = PDEngine(args.model, config, prefill_cpus=split[0], decode_cpus=split[1])
        print(f"pd-split: prefill worker on CPUs {split[0]}, decode worker on {split[1]}")

    async def run() -> dict:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            await engine.wait_ready()
        vocab = engines["single"].engine.model_config.vocab_size
        rounds = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                result = await measure(engine, args, vocab)
                rounds[name].append(result)
                print(f"round {r} {name:8s}: TPOT {result['tpot_quiet_s'] * 1e3:7.1f} ms quiet, "
                      f"{result['tpot_prefill_s'] * 1e3:7.1f} ms while a {args.long_tokens}-token prompt prefills "
                      f"(TTFT {result['long_ttft_s']:.2f} s)", flush=True)
        return rounds

    try:
        rounds = asyncio.run(run())
    finally:
        for engine in engines.values():
            engine.shutdown()
    summary = {}
    for name, results in rounds.items():
        quiet = statistics.median(x["tpot_quiet_s"] for x in results)
        during = statistics.median(x["tpot_prefill_s"] for x in results)
        rise = statistics.median(x["tpot_prefill_s"] / x["tpot_quiet_s"] - 1 for x in results)
        summary[name] = {"tpot_quiet_ms": quiet * 1e3, "tpot_prefill_ms": during * 1e3, "rise": rise,
                         "long_ttft_s": statistics.median(x["long_ttft_s"] for x in results)}
    print(f"\n{'engine':9s} {'TPOT quiet':>11s} {'TPOT in prefill':>16s} {'rise':>8s} {'long TTFT':>10s}")
    for name, s in summary.items():
        print(f"{name:9s} {s['tpot_quiet_ms']:9.1f}ms {s['tpot_prefill_ms']:14.1f}ms {s['rise']:+8.0%} "
              f"{s['long_ttft_s']:9.2f}s")
    print(f"(medians of {args.rounds} rounds; {args.users} users, {args.long_tokens}-token prompt, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}; goal: pd rise < 10%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0], "summary": summary, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
