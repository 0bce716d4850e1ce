"""`bench serve --compare`: the same workload against servers started with a feature on and off, side by side.

A comparison names server flags for its "on" and "off" settings (`COMPARISONS`); several comparisons run every
combination of their settings. Each setting gets a fresh `hybridmoe serve` (the same model and --server-args plus its
flags), the same workload (same seed: the same prompts in the same order), and the engine's own counters scraped
from GET /metrics before and after the workload: decode throughput inside the engine (decode tokens / decode step
seconds, the aggregate over all sequences decoding), and the CPU experts' time and the part the forward waited for.
Settings alternate between rounds (on, off, then off, on, ...) so that a drift of the machine's load falls on both.

Prefill/decode disaggregation (`serve --pd`, hybridmoe.disagg) joins as the comparison "pd" once `hybridmoe serve`
has the flag: `available()` reads serve's own options, so nothing here changes when it lands.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import httpx

from hybridmoe.bench._serving.records import RequestRecord
from hybridmoe.bench._serving.report import PERCENTILES

# name -> ((label, serve flags) on, (label, serve flags) off); "on" forces the feature, whatever auto would choose
COMPARISONS = {
    "overlap": (("overlap on", ["--overlap", "on"]), ("overlap off", ["--no-overlap"])),
    "pd": (("pd on", ["--pd"]), ("pd off", [])),  # needs `hybridmoe serve --pd` (available() checks)
}
ENGINE_COUNTERS = ("engine_steps", "engine_tokens", "engine_step_seconds", "cpu_experts_seconds",
                   "cpu_experts_wait_seconds")


def serve_flags() -> set[str]:
    """The option strings `hybridmoe serve` accepts, from its --help in a subprocess (the bench is a client of the
    server and imports nothing of it)."""
    help_text = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "serve", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text))


def available() -> dict[str, tuple]:
    """The comparisons whose flags this `hybridmoe serve` has."""
    flags = serve_flags()
    return {name: settings for name, settings in COMPARISONS.items()
            if all(f in flags for _, args in settings for f in args if f.startswith("--"))}


def parse(text: str) -> list[str]:
    """--compare's value ("overlap", "overlap,pd") -> comparison names; ValueError naming what is not available."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    usable = available()
    for name in names:
        if name not in COMPARISONS:
            raise ValueError(f"--compare: unknown comparison {name!r}; known: {', '.join(COMPARISONS)}")
        if name not in usable:
            raise ValueError(f"--compare {name}: this `hybridmoe serve` has no {' '.join(COMPARISONS[name][0][1])} "
                             f"flag yet")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--compare needs distinct comparison names, got {text!r}")
    return names


def settings(names: list[str]) -> list[tuple[str, list[str]]]:
    """Every combination of the named comparisons' settings as (label, serve flags), all "on" first."""
    out = []
    for combo in itertools.product(*(COMPARISONS[n] for n in names)):
        out.append((", ".join(label for label, _ in combo), [f for _, flags in combo for f in flags]))
    return out


def engine_counters(url: str, api_key: str | None = None) -> dict[str, float]:
    """The decode phase's RunStats counters from the server's GET /metrics (ENGINE_COUNTERS; {} when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=30.0, trust_env=False).text
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("hybridmoe:")
        if name in ENGINE_COUNTERS:
            out[name] = sum(s.value for s in family.samples
                            if s.labels.get("phase") == "decode" and not s.name.endswith("_created"))
    return out


def engine_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Decode throughput in the engine and its CPU experts' share between two scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}
    seconds, steps = d["engine_step_seconds"], d["engine_steps"]
    timed = steps and d["cpu_experts_seconds"] > 0  # only hybrid execution times the CPU experts
    return {"decode_steps": steps, "decode_tokens": d["engine_tokens"],
            "decode_tok_s": d["engine_tokens"] / seconds if seconds > 0 else None,
            "decode_step_ms": 1e3 * seconds / steps if steps else None,
            "cpu_experts_ms_per_step": 1e3 * d["cpu_experts_seconds"] / steps if timed else None,
            "cpu_waited_ms_per_step": 1e3 * d["cpu_experts_wait_seconds"] / steps if timed else None}


# rows of the side-by-side table: (label, getter(summary, engine), scale, digits)
ROWS = (
    ("decode tok/s in the engine", lambda s, e: e.get("decode_tok_s"), 1, 1),
    ("decode step (ms)", lambda s, e: e.get("decode_step_ms"), 1, 2),
    ("CPU experts per step (ms)", lambda s, e: e.get("cpu_experts_ms_per_step"), 1, 2),
    ("  of it waited for (ms)", lambda s, e: e.get("cpu_waited_ms_per_step"), 1, 2),
    ("output tok/s (HTTP)", lambda s, e: s["output_token_throughput"], 1, 1),
    ("requests/s", lambda s, e: s["request_throughput"], 1, 3),
    *((f"TTFT p{q} (s)", (lambda q: lambda s, e: s["ttft_s"][f"p{q}"])(q), 1, 3) for q in PERCENTILES[:2]),
    *((f"TPOT p{q} (ms)", (lambda q: lambda s, e: s["tpot_s"][f"p{q}"])(q), 1000, 1) for q in PERCENTILES[:2]),
    ("E2E p50 (s)", lambda s, e: s["e2e_s"]["p50"], 1, 3),
    ("SLO attainment (%)", lambda s, e: s["slo"]["attainment"], 100, 1),
    ("completed / failed", None, 0, 0),
)


def format_table(labels: list[str], summaries: list[dict], engines: list[dict]) -> str:
    """Settings as columns, the metrics as rows; a last column with each setting's ratio to the last (the all-"off"
    setting) where there are two settings."""
    width = max(14, *(len(label) + 2 for label in labels))
    ratio = len(labels) == 2
    head = f"{'':28s}" + "".join(f"{label:>{width}s}" for label in labels) + (f"{'ratio':>9s}" if ratio else "")
    lines = [head]
    for name, get, scale, digits in ROWS:
        if get is None:
            cells = [f"{s['completed']} / {s['failed']}" for s in summaries]
            lines.append(f"{name:28s}" + "".join(f"{c:>{width}s}" for c in cells))
            continue
        values = [get(s, e) for s, e in zip(summaries, engines)]
        cells = ["-" if v is None else f"{v * scale:.{digits}f}" for v in values]
        line = f"{name:28s}" + "".join(f"{c:>{width}s}" for c in cells)
        if ratio and None not in values and values[1]:
            line += f"{values[0] / values[1]:>8.2f}x"
        lines.append(line)
    return "\n".join(lines)


def plot(path: str, labels: list[str], records: list[list[RequestRecord]], summaries: list[dict],
         engines: list[dict], title: str) -> None:
    """A PNG: TTFT and TPOT CDFs of every setting on shared axes, and the engine's decode tok/s and the HTTP
    output tok/s of each setting as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, mine) in enumerate(zip(labels, records)):
        ok = [r for r in mine if r.status == "ok"]
        for ax, key, scale in ((axes[0], "ttft_s", 1.0), (axes[1], "tpot_s", 1000.0)):
            values = np.sort([getattr(r, key) * scale for r in ok if getattr(r, key) is not None])
            if len(values):
                ax.step(np.concatenate([values[:1], values]), np.arange(len(values) + 1) / len(values),
                        where="post", color=colors[i % len(colors)], label=label)
    axes[0].set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    axes[1].set(xlabel="TPOT (ms)", ylabel="fraction of requests", title="TPOT CDF", ylim=(0, 1.02))
    x = np.arange(len(labels))
    decode = [e.get("decode_tok_s") or 0.0 for e in engines]
    http = [s["output_token_throughput"] for s in summaries]
    axes[2].bar(x - 0.2, decode, 0.4, label="decode tok/s in the engine",
                color=[colors[i % len(colors)] for i in range(len(labels))])
    axes[2].bar(x + 0.2, http, 0.4, label="output tok/s over HTTP", color="lightgrey", edgecolor="black")
    axes[2].set_xticks(x, labels, fontsize=8)
    axes[2].set(title="throughput", ylabel="tokens/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
