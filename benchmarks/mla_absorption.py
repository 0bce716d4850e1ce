"""MLA's two absorbed kv_b_proj products on the C++ kernels (kernels.moe.matmul_heads) against torch's bmm over the
heads, side by side in one process (issue 42; not run by CI).

    python benchmarks/mla_absorption.py --layer-only [--tokens 1,2,4,8,16,32,64,128,256] [--layers 16] [--rounds 5]
    python benchmarks/mla_absorption.py [--model demo] [--decode-tokens 128] [--rounds 5]

--layer-only times one layer's two products at DeepSeek-V3's shape (N = 128 heads, P = V = 128, L = 512, R = 64,
bf16): q_nope (a view of q [T, N, P+R]) through W_uk into the first L columns of [T, N, L+R], and out_lat [T, N, L]
through W_uv, as layers/attention_mla.Absorption runs them. The weights rotate over --layers layers' copies (32 MB
each: 16 of them are more than this VM's 480 MB L3), so they come from memory as in a decode step. Variants:
"kernel" (matmul_heads, --threads pool threads), "bmm" (per_head on the weights as the engine holds them: W_uk^T
made at load, transposed back as a view), "bmm kv_b" (per_head on views of kv_b_proj, the engine before: shows that
the transposed W_uk costs torch's bmm nothing at prefill sizes). torch runs on one thread up to 64 tokens and on
--threads from there, as the engine's steps do (model_runner.SINGLE_THREAD_MAX_TOKENS). Every variant runs
--calls calls a round; variants alternate within a round, their order flipping every round. Cells: median over the
rounds of each round's median call.

Without --layer-only: decode tok/s of one engine (the demo model by default), --decode-tokens greedy tokens after a
short prompt, with the absorption on the kernels (the engine) and on torch's bmm
(`attention_mla.ABSORB_KERNEL_MAX_TOKENS = 0`), alternating, the order flipping every round. Cells: median (best).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def layer_only(tokens: list[int], layers: int, rounds: int, calls: int, threads: int) -> None:
    import torch

    from hybridmoe.config import AttentionConfig
    from hybridmoe.kernels import isa
    from hybridmoe.kernels.moe import matmul_heads
    from hybridmoe.layers.attention_mla import Absorption, per_head, uk_transposed, uv_heads

    N, P, R, V, L = 128, 128, 64, 128, 512
    att = AttentionConfig(kind="mla", num_heads=N, num_kv_heads=N, head_dim=P + R, softmax_scale=(P + R) ** -0.5,
                          qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V, kv_lora_rank=L, q_lora_rank=1536)
    gen = torch.Generator().manual_seed(0)
    kv_bs = [(torch.randn(N * (P + V), L, generator=gen) * L ** -0.5).bfloat16() for _ in range(layers)]
    absorptions = [Absorption(uk_transposed(kv_b, att), uv_heads(kv_b, att)) for kv_b in kv_bs]
    old_uk = [kv_b.view(N, P + V, L)[:, :P] for kv_b in kv_bs]  # [N, P, L] views: the engine before

    def variant(name: str, i: int, q_nope, q_full, out_lat):
        a = absorptions[i]
        if name == "kernel":
            matmul_heads(a.uk, q_nope, q_full[..., :L])
            return matmul_heads(a.uv, out_lat, out_dtype=out_lat.dtype)
        q_full[..., :L] = per_head(q_nope, a.w_uk if name == "bmm" else old_uk[i])
        return per_head(out_lat, a.w_uv_t)

    names = ("kernel", "bmm", "bmm kv_b")
    print(f"DeepSeek-V3 absorption, one layer's two products (N={N}, P=V={P}, L={L}, bf16), weights rotating over "
          f"{layers} layers ({layers * kv_bs[0].nbytes / 2**20:.0f} MB), {threads} kernel threads, ISA "
          f"{isa.active_isa()}; median over {rounds} rounds of each round's median of {calls} calls")
    print(f"{'T':>5} " + " ".join(f"{n:>11}" for n in names) + "   bmm / kernel")
    for t in tokens:
        torch.set_num_threads(1 if t <= 64 else threads)
        q = torch.randn(t, N, P + R, generator=gen).bfloat16()
        q_nope, q_full = q[..., :P], torch.empty(t, N, L + R, dtype=torch.bfloat16)
        out_lat = torch.randn(t, N, L, generator=gen).bfloat16()
        ref = variant("bmm kv_b", 0, q_nope, q_full, out_lat).float()
        got = variant("kernel", 0, q_nope, q_full, out_lat).float()
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max(), "kernel and bmm disagree"
        medians: dict[str, list[float]] = {n: [] for n in names}
        k = 0
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                seconds = []
                for _ in range(calls):
                    start = time.perf_counter()
                    variant(name, k % layers, q_nope, q_full, out_lat)
                    seconds.append(time.perf_counter() - start)
                    k += 1
                medians[name].append(statistics.median(seconds))
        cell = {n: statistics.median(v) for n, v in medians.items()}
        print(f"{t:5d} " + " ".join(f"{1e6 * cell[n]:9.0f}us" for n in names) +
              f"   {cell['bmm'] / cell['kernel']:.2f}x", flush=True)


def engine_decode(model: str, decode_tokens: int, rounds: int) -> None:
    from hybridmoe.bench._greedy_decode import timed_greedy_decode
    from hybridmoe.kernels import isa
    from hybridmoe.layers import attention_mla
    from hybridmoe.runtime.llm import LLM

    llm = LLM(model)
    engine = llm.engine
    prompt = "The quick brown fox"
    kernel_max = attention_mla.ABSORB_KERNEL_MAX_TOKENS

    def decode(variant: str, steps: int) -> dict:
        attention_mla.ABSORB_KERNEL_MAX_TOKENS = kernel_max if variant == "kernel" else 0
        tok_s, tokens = timed_greedy_decode(engine, prompt, steps)
        return {"tok_s": tok_s, "tokens": tokens}

    decode("kernel", 4)
    decode("bmm", 4)
    runs: dict[str, list[dict]] = {"kernel": [], "bmm": []}
    for r in range(rounds):
        for name in (("kernel", "bmm") if r % 2 == 0 else ("bmm", "kernel")):
            runs[name].append(decode(name, decode_tokens))
            print(f"round {r + 1} {name:7s} {runs[name][-1]['tok_s']:7.2f} tok/s", flush=True)
    same = all(x["tokens"] == y["tokens"] for x, y in zip(runs["kernel"], runs["bmm"]))
    cell = {n: statistics.median(x["tok_s"] for x in v) for n, v in runs.items()}
    print(f"\nmodel {model}, {decode_tokens} greedy decode tokens, ISA {isa.active_isa()}, "
          f"{isa.num_threads()} kernel threads")
    for n, v in runs.items():
        print(f"  absorption on {n:7s} decode {cell[n]:7.2f} ({max(x['tok_s'] for x in v):.2f}) tok/s")
    print(f"  kernel / bmm: {cell['kernel'] / cell['bmm']:.3f}x; same greedy tokens: {same}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer-only", action="store_true")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="demo")
    p.add_argument("--decode-tokens", type=int, default=128)
    a = p.parse_args()
    os.environ["HYBRIDMOE_NUM_THREADS"] = str(a.threads)
    import torch

    from hybridmoe.kernels import isa

    torch.set_num_threads(a.threads)
    isa.configure_threads(a.threads)
    with torch.inference_mode():
        if a.layer_only:
            layer_only([int(t) for t in a.tokens.split(",")], a.layers, a.rounds, a.calls, a.threads)
        else:
            engine_decode(a.model, a.decode_tokens, a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
