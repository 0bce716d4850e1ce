"""Plain-text tables of plans, simulations and the paper comparison (what the CLI prints)."""

from __future__ import annotations

import math

from hybridmoe.placement.planner import Item, Plan

GB = 1e9


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _layers(layers: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> "0-2, 5-6"."""
    if not layers:
        return ""
    runs, start, prev = [], layers[0], layers[0]
    for l in layers[1:] + [None]:
        if l is not None and l == prev + 1:
            prev = l
            continue
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        if l is not None:
            start = prev = l
    return ", ".join(runs)


def _hot_count(item: Item) -> int:
    return int(item.name.split("(")[1].split()[0])  # "hot experts.L (n of E)"


def _groups(items: tuple[Item, ...]) -> list[tuple[str, str, float, bool, int]]:
    """Consecutive per-layer items of one kind and residency, and all hot experts, as one row each:
    (what, layers, bytes, resident, count)."""
    out: list[tuple[str, list[int], float, bool, int]] = []
    for item in items:
        per_layer = item.layer is not None and item.kind in ("attention", "router", "shared", "dense")
        hot = item.kind == "expert" and item.resident
        name = "hot experts" if hot else item.kind if per_layer else item.name
        count = _hot_count(item) if hot else 1
        last = out[-1] if out else None
        if last and (per_layer or hot) and last[0] == name and last[3] == item.resident:
            out[-1] = (name, last[1] + [item.layer], last[2] + item.nbytes, item.resident, last[4] + count)
        else:
            out.append((name, [item.layer] if per_layer or hot else [], item.nbytes, item.resident, count))
    return [(name, _layers(layers), nbytes, resident, count) for name, layers, nbytes, resident, count in out]


def format_plan(plan: Plan) -> str:
    lines = [f"Plan: {plan.model} on {plan.machine}: VRAM budget {plan.budget_bytes / GB:.1f} GB, "
             f"{plan.resident_bytes / GB:.2f} GB placed; routed experts {plan.expert_format}, other weights "
             f"{plan.dense_format}; context {plan.context}, concurrency {plan.concurrency}", ""]
    if plan.items:
        rows = []
        for i, (name, layers, nbytes, resident, count) in enumerate(_groups(plan.items), 1):
            what = name if name != "hot experts" else f"hot experts ({count}, by routing frequency)"
            rows.append([str(i), what, layers, f"{nbytes / GB:.2f} GB", "GPU" if resident else "host"])
        lines += ["What goes where (accelerator memory is filled in this order, as a prefix):",
                  _table(["#", "what", "layers", "bytes", "lives in"], rows, right={3}), ""]
    else:
        lines += ["No accelerator: every weight stays in host memory and runs on the CPU.", ""]
    rows = []
    for t in plan.tiers:
        streamed = _summary(t.streamed)
        cpu = _summary(t.on_cpu)
        rows.append([str(t.batch), f"{t.step_s * 1e3:.1f}", f"{t.tok_s:.1f}", "yes" if t.dual_batch else "no",
                     t.experts_on, streamed or "-", cpu or "-"])
    lines += ["Decode, per batch tier (non-resident parts run where they are faster):",
              _table(["batch", "step ms", "tok/s", "dual-batch", "routed experts", "streamed", "on CPU"], rows,
                     right={0, 1, 2}), ""]
    if plan.prefill:
        names = sorted({k for c in plan.prefill for k in c.ttft_by_strategy})
        rows = [[str(c.prompt_tokens), c.strategy, f"{c.ttft_s:.2f}",
                 *[f"{c.ttft_by_strategy[k]:.2f}" if k in c.ttft_by_strategy else "-" for k in names],
                 str(c.chunk_tokens)] for c in plan.prefill]
        lines += ["Prefill (predicted TTFT, seconds):",
                  _table(["prompt", "best", "TTFT s", *[f"{k} s" for k in names], "chunk"], rows,
                         right={0, 2, 3, 4, 5, 6}), ""]
    if plan.crossover_tokens is not None:
        lines.append(f"Stream-loading prefill is fastest from {plan.crossover_tokens} prompt tokens on.")
    elif plan.items:
        lines.append(f"Stream-loading prefill does not beat CPU/hybrid prefill up to {plan.context} tokens.")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _summary(parts: tuple[str, ...]) -> str:
    """("attention.3", "attention.4", "experts.3") -> "attention 3-4; experts 3"."""
    by_kind: dict[str, list[int]] = {}
    for part in parts:
        kind, layer = part.rsplit(".", 1)
        by_kind.setdefault(kind, []).append(int(layer))
    return "; ".join(f"{kind} {_layers(sorted(layers))}" for kind, layers in by_kind.items())


def format_records(records) -> str:
    rows = []
    for r in records:
        ttft = "inf" if math.isinf(r.ttft_s) else f"{r.ttft_s:.1f}"
        rows.append([r.hardware, str(r.gpus), r.strategy, r.weight_format,
                     f"{r.prompt_tokens}{' (longest in 30 s)' if r.longest_within_30s else ''}", ttft,
                     f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}"])
    return _table(["hardware", "gpus", "strategy", "experts", "prompt", "TTFT s", "prefill tok/s", "decode tok/s"],
                  rows, right={1, 5, 6, 7})


def format_comparison(figures) -> str:
    rows = [[f.claim, f"{f.paper:g} {f.unit}", f"{f.predicted:.1f} {f.unit}", f"{(f.ratio - 1) * 100:+.1f}%",
             "fitted" if f.fitted else "predicted"] for f in figures]
    return _table(["figure", "paper", "ours", "diff", ""], rows, right={1, 2, 3})


def plan_to_json(plan: Plan) -> dict:
    """The plan as plain JSON data (bytes, seconds, tokens/s)."""
    return {
        "model": plan.model, "machine": plan.machine, "expert_format": plan.expert_format,
        "dense_format": plan.dense_format, "budget_bytes": plan.budget_bytes, "resident_bytes": plan.resident_bytes,
        "context": plan.context, "concurrency": plan.concurrency,
        "items": [{"name": i.name, "kind": i.kind, "layer": i.layer, "bytes": i.nbytes, "resident": i.resident}
                  for i in plan.items],
        "tiers": [{"batch": t.batch, "step_s": t.step_s, "tok_s": t.tok_s, "dual_batch": t.dual_batch,
                   "routed_experts": t.experts_on, "streamed": list(t.streamed), "on_cpu": list(t.on_cpu)}
                  for t in plan.tiers],
        "prefill": [{"prompt_tokens": c.prompt_tokens, "strategy": c.strategy, "ttft_s": c.ttft_s,
                     "ttft_by_strategy_s": c.ttft_by_strategy, "chunk_tokens": c.chunk_tokens}
                    for c in plan.prefill],
        "slp_crossover_tokens": plan.crossover_tokens, "decode_tok_s": plan.decode_tok_s,
        "routing_measured": plan.routing_measured, "notes": list(plan.notes),
        # each MoE layer's hot experts, by decoder layer (what `--plan FILE` places on the accelerator)
        "hot_experts": {str(layer): list(ids) for layer, ids in
                        zip(sorted({i.layer for i in plan.items if i.kind == "router"}), plan.residency.hot) if ids},
    }
