"""The model side of `hybridmoe eval kv` and `eval kv-probe`: prefill a prompt on the engine's model, score its
tokens, hand its KV over through a real SpectrumKV payload into a fresh paged cache, and decode or score a
continuation against what arrived (dropped tokens masked, positions kept).

One sequence at a time, its block table the identity (token position p in slot p). The receiver recomputes
the prompt's last token against the handed-over cache, so the first generated token, too, depends on the
compression (a disaggregated prefill would send that token along).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridmoe.kv.allocation import LADDER_3, Tier, allocate
from hybridmoe.kv.importance import WINDOW, AttentionImportance, position_importance
from hybridmoe.kv.layout import KVLayout
from hybridmoe.kv.payload import FULL_DTYPES, PayloadReader, PayloadWriter
from hybridmoe.kv.probe import model_fingerprint

BLOCK_SIZE = 16

# The passkey prompt the demo model was trained on (training/passkey.py, classic filler), with the needle's
# depth chosen instead of drawn.
INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(key: str, depth: float, target_tokens: int, count_tokens) -> str:
    """About target_tokens tokens of filler with the needle at `depth` (0 start, 1 end), then the question."""
    fixed = count_tokens(f"{INTRO}\n{NEEDLE.format(key=key)}\n{QUESTION}") + 4
    units = max(1, round((target_tokens - fixed) / (count_tokens(CLASSIC_FILLER) + 1)))
    split = round(depth * units)
    parts = [INTRO, " ".join([CLASSIC_FILLER] * split), NEEDLE.format(key=key),
             " ".join([CLASSIC_FILLER] * (units - split)), QUESTION]
    return "\n".join(p for p in parts if p)


def reference_text() -> str:
    """Text for continuation perplexity when none is given: docstrings of Python's standard library (the demo
    model was trained on the Python documentation, among others), the same for one Python version."""
    import argparse
    import collections
    import functools
    import itertools
    import json
    import pathlib
    import random
    import re
    import string
    import textwrap

    docs = []
    for module in (collections, functools, itertools, json, pathlib, random, re, string, textwrap, argparse):
        docs.append(inspect.getdoc(module) or "")
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
                docs.append(inspect.getdoc(obj) or "")
    return "\n\n".join(d for d in docs if len(d) > 200)


@dataclass
class Handoff:
    caches: list[torch.Tensor]
    dropped: torch.Tensor  # bool [n]
    payload_bytes: int
    full_bytes: int  # the same tokens' KV at 16 bits
    pack_s: float
    unpack_s: float


class KVHarness:
    def __init__(self, model_dir: str | Path, dtype: str = "float32"):
        from hybridmoe.models.loader import load_model
        from hybridmoe.runtime.tokenizer import load_tokenizer

        self.model_dir = Path(model_dir)
        self.model = load_model(model_dir, dtype, "cpu", show_progress=False)
        self.tokenizer = load_tokenizer(model_dir)
        self.config = self.model.config
        self.layout = KVLayout.from_config(self.config)
        self.fingerprint = model_fingerprint(model_dir)
        self.full_dtype = self.config.torch_dtype if self.config.torch_dtype in FULL_DTYPES else "bfloat16"
        self.int4_verdict = "unknown"  # what payload headers say about the probe ("int4-allowed", ...)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def new_caches(self, tokens: int) -> list[torch.Tensor]:
        shape = self.model.kv_cache_shape(-(-tokens // BLOCK_SIZE), BLOCK_SIZE)
        return [torch.zeros(shape, dtype=self.model.dtype) for _ in range(self.config.num_layers)]

    def forward(self, ids: list[int], start: int, caches: list[torch.Tensor], dropped: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """ids at positions start.. into caches -> logits [T or 1, V]; dropped [>= start] masks those keys."""
        from hybridmoe.layers.paged_attention import AttentionMetadata

        end = start + len(ids)
        blocks = caches[0].shape[-4] if self.layout.kind == "gqa" else caches[0].shape[0]
        mask = None
        if dropped is not None:
            mask = torch.zeros(end, dtype=torch.bool)
            mask[: dropped.shape[0]] = dropped[:end]
            mask[start:end] = False  # the tokens being computed now are there
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), block_tables=torch.arange(blocks)[None],
                                 query_lens=[len(ids)], seq_lens=[end], block_size=BLOCK_SIZE,
                                 dropped=None if mask is None else [mask])
        last = None if all_logits else torch.tensor([len(ids) - 1])
        return self.model.forward(torch.tensor(ids), torch.arange(start, end), meta, caches, last)

    def prefill(self, ids: list[int], capacity: int, window: int = WINDOW
                ) -> tuple[list[torch.Tensor], torch.Tensor, AttentionImportance]:
        """-> (caches holding the prompt's KV, logits of its last token [1, V], its attention importance)."""
        caches = self.new_caches(capacity)
        observer = AttentionImportance(len(ids), window)
        remove = self.model.add_attention_observer(observer)
        try:
            logits = self.forward(ids, 0, caches)
        finally:
            remove()
        return caches, logits, observer

    def importance(self, method: str, observer: AttentionImportance, num_tokens: int) -> torch.Tensor:
        if method == "attention":
            return observer.scores()
        if method == "position":
            return position_importance(num_tokens)
        raise ValueError(f"unknown importance {method!r}")

    def handoff(self, caches: list[torch.Tensor], num_tokens: int, tiers: torch.Tensor,
                ladder: tuple[Tier, ...] = LADDER_3, capacity: int | None = None, full_dtype: str | None = None,
                int4_verdict: str | None = None) -> Handoff:
        """Pack the first num_tokens tokens' KV at `tiers` into a payload, unpack it into fresh caches."""
        slots = torch.arange(num_tokens)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # packing is a chain of short elementwise passes: one thread (see docs)
        try:
            return self._handoff(caches, num_tokens, tiers, ladder, capacity, full_dtype, int4_verdict, slots)
        finally:
            torch.set_num_threads(threads)

    def _handoff(self, caches, num_tokens, tiers, ladder, capacity, full_dtype, int4_verdict, slots) -> Handoff:
        start = time.perf_counter()
        writer = PayloadWriter(self.layout, tiers, model=self.fingerprint, full_dtype=full_dtype or self.full_dtype,
                               ladder=ladder, int4_verdict=int4_verdict or self.int4_verdict)
        parts = [writer.head()] + [writer.pack_layer(i, self.layout.rows_from_cache(c, slots))
                                   for i, c in enumerate(caches)]
        data = b"".join(parts)
        pack_s = time.perf_counter() - start
        start = time.perf_counter()
        reader = PayloadReader(data, model=self.fingerprint, layout=self.layout)
        out = self.new_caches(capacity or num_tokens)
        view = memoryview(data)
        for i, cache in enumerate(out):
            lo, hi = reader.segment_range(i)
            self.layout.rows_to_cache(cache, slots, reader.unpack_layer(i, view[lo:hi], cache.dtype))
        unpack_s = time.perf_counter() - start
        return Handoff(out, reader.dropped, len(data), self.layout.full_bytes(num_tokens), pack_s, unpack_s)

    def greedy(self, ids: list[int], caches: list[torch.Tensor], dropped: torch.Tensor | None,
               max_new_tokens: int) -> list[int]:
        """Recompute the prompt's last token against caches, then decode greedily."""
        n = len(ids)
        logits = self.forward(ids[-1:], n - 1, caches, dropped)
        out: list[int] = []
        eos = set(self.config.eos_token_ids)
        for step in range(max_new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            if token in eos or step == max_new_tokens - 1:
                break
            logits = self.forward([token], n + step, caches, dropped)
        return out

    def continuation_nll(self, ids: list[int], prefix: int, caches: list[torch.Tensor],
                         dropped: torch.Tensor | None) -> tuple[float, int]:
        """Teacher-force ids[prefix:] against caches holding ids[:prefix] (the prefix's last token recomputed)
        -> (summed negative log-likelihood, predicted tokens)."""
        inputs = ids[prefix - 1: -1]
        logits = self.forward(inputs, prefix - 1, caches, dropped, all_logits=True)
        targets = torch.tensor(ids[prefix:])
        return float(F.cross_entropy(logits.float(), targets, reduction="sum")), len(targets)


def perplexity(nll: float, count: int) -> float:
    return math.exp(nll / max(1, count))


# ---- the probe and the evaluation ----

PROBE_DEPTHS = (0.25, 0.5, 0.75)


def probe_trials(harness: KVHarness, tokens: int = 1024, budget: float = 0.3, seed: int = 46) -> list[bool]:
    """Needle trials under the three-tier ladder at `budget`, tokens ranked by position only, so the needle
    (at depths 0.25, 0.5, 0.75) lands in the INT4 tier: the trial asks whether INT4 keys and values can still
    be retrieved. (Attention importance would lift the needle into INT8 and hide an intolerant model.)"""
    import random

    rng = random.Random(seed)
    successes = []
    for depth in PROBE_DEPTHS:
        key = str(rng.randint(10000, 99999))
        ids = harness.encode(passkey_prompt(key, depth, tokens, harness.count_tokens))
        n = len(ids)
        caches, _, _ = harness.prefill(ids, n + 16)
        tiers = allocate(position_importance(n), budget, LADDER_3)
        handoff = harness.handoff(caches, n, tiers, LADDER_3, n + 16)
        out = harness.tokenizer.decode(harness.greedy(ids, handoff.caches, handoff.dropped, 8))
        successes.append(key in out)
    return successes


@dataclass(frozen=True)
class Method:
    name: str
    importance: str  # "attention" | "position"
    ladder: tuple[Tier, ...]
    fixed_budget: float | None = None  # uniform quantisation: one budget only


def methods(ladder: tuple[Tier, ...]) -> list[Method]:
    return [Method("spectrumkv-attention", "attention", ladder), Method("spectrumkv-position", "position", ladder),
            Method("pdtrim", "position", (Tier.FULL,)), Method("uniform-int8", "position", (Tier.INT8,), 0.5),
            Method("uniform-int4", "position", (Tier.INT4,), 0.25)]


def evaluate(harness: KVHarness, budgets: list[float], ladder: tuple[Tier, ...], *, prefix_tokens: int = 512,
             continuation_tokens: int = 64, windows: int = 8, passkey_tokens: int = 1024, depths: int = 10,
             text: str | None = None, seed: int = 46, log=print) -> list[dict]:
    """Every method at every budget: continuation perplexity, passkey accuracy, payload bytes -> rows (the
    full-KV reference first: budget 1.0, method "full"). payload_bytes: the mean payload of the passkey prompts
    (the reference: their 16-bit KV); payload_fraction: payload over 16-bit KV bytes, everything counted."""
    import random

    configs = [("full", None, 1.0)]
    for m in methods(ladder):
        configs += [(m.name, m, b) for b in ([m.fixed_budget] if m.fixed_budget else budgets)]
    stats = {c[0] + f"@{c[2]}": {"nll": 0.0, "count": 0, "hits": 0, "trials": 0, "payload": [], "full": []}
             for c in configs}

    def run(name, method, budget, ids, n, caches, observer, score, record=False):
        s = stats[f"{name}@{budget}"]
        if method is None:
            if record:
                s["payload"].append(harness.layout.full_bytes(n))
                s["full"].append(harness.layout.full_bytes(n))
            score(s, caches, None)
            return
        tiers = allocate(harness.importance(method.importance, observer, n), budget, method.ladder)
        h = harness.handoff(caches, n, tiers, method.ladder, len(ids) + 16)
        if record:  # payload sizes of the passkey prompts
            s["payload"].append(h.payload_bytes)
            s["full"].append(h.full_bytes)
        score(s, h.caches, h.dropped)

    tokens = harness.encode(text or reference_text())
    span = prefix_tokens + continuation_tokens
    if len(tokens) < span:
        raise ValueError(f"the text has {len(tokens)} tokens, one window needs {span}")
    windows = min(windows, len(tokens) // span)
    for w in range(windows):
        ids = tokens[w * span: (w + 1) * span]
        caches, _, observer = harness.prefill(ids[:prefix_tokens], span)

        def score(s, c, dropped, ids=ids):
            nll, count = harness.continuation_nll(ids, prefix_tokens, c, dropped)
            s["nll"] += nll
            s["count"] += count

        for name, method, budget in configs:
            run(name, method, budget, ids, prefix_tokens, caches, observer, score)
        log(f"perplexity window {w + 1}/{windows}")

    rng = random.Random(seed)
    for i in range(depths):
        depth = 0.05 + 0.9 * i / max(1, depths - 1)
        key = str(rng.randint(10000, 99999))
        ids = harness.encode(passkey_prompt(key, depth, passkey_tokens, harness.count_tokens))
        n = len(ids)
        caches, _, observer = harness.prefill(ids, n + 16)

        def score(s, c, dropped, ids=ids, key=key):
            out = harness.tokenizer.decode(harness.greedy(ids, c, dropped, 8))
            s["hits"] += key in out
            s["trials"] += 1

        for name, method, budget in configs:
            run(name, method, budget, ids, n, caches, observer, score, record=True)
        log(f"passkey depth {depth:.2f} ({n} tokens)")

    rows = []
    full_ppl = perplexity(stats["full@1.0"]["nll"], stats["full@1.0"]["count"])
    for name, method, budget in configs:
        s = stats[f"{name}@{budget}"]
        ppl = perplexity(s["nll"], s["count"])
        row = {"method": name, "budget": budget, "ppl": round(ppl, 4),
               "ppl_delta_pct": round(100 * (ppl / full_ppl - 1), 3), "passkey_acc": round(s["hits"] / s["trials"], 3),
               "payload_bytes": round(sum(s["payload"]) / len(s["payload"])) if s["payload"] else None,
               "payload_fraction": round(sum(s["payload"]) / sum(s["full"]), 4) if s["payload"] else None}
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["method"] for r in rows if r["method"] != "full"]
    for name in dict.fromkeys(names):
        pts = sorted((r["budget"], r["ppl_delta_pct"], r["passkey_acc"]) for r in rows if r["method"] == name)
        style = "o-" if len(pts) > 1 else "s"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax2.plot([p[0] for p in pts], [100 * p[2] for p in pts], style, label=name)
    ax1.axhline(0, color="gray", lw=0.8)
    ax1.set_xlabel("budget b (fraction of 16-bit KV bytes)")
    ax1.set_ylabel("continuation perplexity change vs full KV (%)")
    ax2.set_xlabel("budget b")
    ax2.set_ylabel("passkey accuracy (%)")
    ax2.set_ylim(-5, 105)
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def json_rows(model: str, kind: str, ladder: list[str], rows: list[dict], rates: list[dict]) -> list[dict]:
    """`eval kv --json`: a list of {method, budget, ppl, ppl_delta_pct, passkey_acc, payload_bytes, ...}, each row
    naming the model, its KV layout and the tier ladder, then the pack/unpack timings as rows of method
    "pack-unpack" (tokens, budget, payload and full bytes, GB/s; no quality fields)."""
    context = {"model": model, "kind": kind, "ladder": ladder}
    return [{**row, **context} for row in rows] + [{"method": "pack-unpack", **rate, **context} for rate in rates]


def bench_pack(harness: KVHarness, tokens: int, budget: float, ladder: tuple[Tier, ...], repeats: int = 5) -> dict:
    """Pack and unpack rates of one prompt's payload (random KV rows in the model's layout): best of `repeats`,
    GB/s of 16-bit KV handled."""
    n = tokens
    caches = [torch.randn(c.shape) for c in harness.new_caches(n)]
    tiers = allocate(position_importance(n), budget, ladder)
    best_pack = best_unpack = float("inf")
    for _ in range(repeats):
        h = harness.handoff(caches, n, tiers, ladder, n)
        best_pack, best_unpack = min(best_pack, h.pack_s), min(best_unpack, h.unpack_s)
    full = harness.layout.full_bytes(n)
    return {"tokens": n, "budget": budget, "payload_bytes": h.payload_bytes, "full_bytes": full,
            "pack_gbps": round(full / best_pack / 1e9, 3), "unpack_gbps": round(full / best_unpack / 1e9, 3)}
