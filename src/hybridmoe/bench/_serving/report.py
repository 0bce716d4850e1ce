"""A `bench serve` run's summary (`summarize`), its printed table (`format_summary`), JSON (`write_json`) and
figure (`plot`).

Percentiles interpolate linearly between the finished requests' values (numpy's default). Latencies describe
the requests that finished; throughputs divide their requests and tokens by the run's wall time. A request meets
the SLO when it finished with TTFT <= the TTFT target and TPOT <= the TPOT target (a reply of one token has no
TPOT and is judged on its TTFT); attainment is the fraction of the requests that finished or failed (a failed one
misses), leaving out those cancelled by the run's time bound, whose latencies are unknown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridmoe.bench._serving.records import RequestRecord, RunResult
from hybridmoe.bench._serving.workload import KINDS

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 30.0
    tpot_s: float = 0.050

    def met(self, r: RequestRecord) -> bool:
        return r.status == "ok" and r.ttft_s <= self.ttft_s and (r.tpot_s is None or r.tpot_s <= self.tpot_s)


def distribution(values: list[float]) -> dict:
    """mean and PERCENTILES of values (None for each when there are none)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    data = np.asarray(values, dtype=np.float64)
    return {"mean": float(data.mean()), **{f"p{q}": float(np.percentile(data, q)) for q in PERCENTILES}}


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    """Counts, latency distributions, throughputs and SLO attainment of a run's records."""
    ok = [r for r in records if r.status == "ok"]
    judged = [r for r in records if r.status in ("ok", "error")]
    by_kind = {}
    for kind in KINDS:
        mine = [r for r in ok if r.kind == kind]
        prompts = [r.prompt_tokens for r in mine if r.prompt_tokens is not None]
        by_kind[kind] = {"completed": len(mine),
                         "prompt_tokens_mean": float(np.mean(prompts)) if prompts else None,
                         "output_tokens_mean": float(np.mean([r.output_tokens for r in mine])) if mine else None,
                         "ttft_s": distribution([r.ttft_s for r in mine]),
                         "tpot_s": distribution([r.tpot_s for r in mine if r.tpot_s is not None])}
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": sum(r.status == "error" for r in records),
        "cancelled": sum(r.status == "cancelled" for r in records),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration_s,
        "prompt_token_throughput": sum(r.prompt_tokens or 0 for r in ok) / duration_s,
        "ttft_s": distribution([r.ttft_s for r in ok]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                "attainment": _fraction(sum(slo.met(r) for r in judged), len(judged)),
                "ttft_attainment": _fraction(sum(r.status == "ok" and r.ttft_s <= slo.ttft_s for r in judged),
                                             len(judged)),
                "tpot_attainment": _fraction(sum(r.status == "ok" and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)
                                                 for r in judged), len(judged))},
        "by_kind": by_kind,
    }


def _cell(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_summary(summary: dict) -> str:
    """The summary as the lines `bench serve` prints."""
    s, slo = summary, summary["slo"]
    lines = [f"{s['requests']} requests in {s['duration_s']:.1f} s: {s['completed']} completed, "
             f"{s['failed']} failed, {s['cancelled']} cancelled at the time limit",
             f"{'':10s} {'mean':>9s} " + " ".join(f"{f'p{q}':>9s}" for q in PERCENTILES)]
    for key, label, scale, digits in (("ttft_s", "TTFT (s)", 1, 3), ("tpot_s", "TPOT (ms)", 1000, 1),
                                      ("e2e_s", "E2E (s)", 1, 3)):
        d = s[key]
        lines.append(f"{label:10s} " + " ".join(f"{_cell(d[k], scale, digits):>9s}"
                                                  for k in ("mean", *(f"p{q}" for q in PERCENTILES))))
    lines.append(f"throughput: {s['request_throughput']:.3f} requests/s, {s['output_token_throughput']:.1f} "
                 f"output tokens/s, {s['prompt_token_throughput']:.1f} prompt tokens/s")
    lines.append(f"SLO (TTFT <= {slo['ttft_s']:g} s and TPOT <= {1000 * slo['tpot_s']:g} ms): "
                 f"{_percent(slo['attainment'])} of requests (TTFT alone {_percent(slo['ttft_attainment'])}, "
                 f"TPOT alone {_percent(slo['tpot_attainment'])})")
    for kind, k in s["by_kind"].items():
        if k["completed"]:
            prompt = "-" if k["prompt_tokens_mean"] is None else f"{k['prompt_tokens_mean']:.0f}"
            lines.append(f"{kind}: {k['completed']} completed, {prompt} prompt tokens and "
                         f"{k['output_tokens_mean']:.1f} output tokens on average, TTFT p50 "
                         f"{_cell(k['ttft_s']['p50'], 1, 3)} s, TPOT p50 {_cell(k['tpot_s']['p50'], 1000, 1)} ms")
    return "\n".join(lines)


def write_json(path: str | Path, result: RunResult, summary: dict, extra_settings: dict | None = None) -> None:
    """{settings, run, summary, requests}: the run's settings (with `extra_settings`), when it ran and what the
    load generator used, its summary and every record."""
    report = {"settings": {**result.settings(), "slo": {k: summary["slo"][k] for k in ("ttft_s", "tpot_s")},
                           **(extra_settings or {})},
              "run": result.run_info(), "summary": summary, "requests": result.records_as_dicts()}
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


SLO_SHOWN_UP_TO = 3.0  # a target more than this many times the largest value is named, not drawn (it would
# squeeze the values against the axis)


def _cdf(ax, values, **style) -> None:
    """An empirical CDF: 0 before the smallest value, a step of 1/n at each."""
    values = np.sort(values)
    ax.step(np.concatenate([values[:1], values]), np.arange(len(values) + 1) / len(values), where="post", **style)


def plot(path: str | Path, result: RunResult, summary: dict, title: str | None = None) -> None:
    """A PNG: TTFT and TPOT of each finished request against the time it was sent (top), and their CDFs
    (bottom), long prompts and chat turns apart, the SLO targets dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    ok = [r for r in result.records if r.status == "ok"]
    slo = summary["slo"]
    metrics = (("ttft_s", "TTFT", "s", 1.0, slo["ttft_s"]), ("tpot_s", "TPOT", "ms", 1000.0, slo["tpot_s"]))
    styles = {"long": dict(color="tab:orange", marker="s"), "chat": dict(color="tab:blue", marker="o")}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for column, (key, name, unit, scale, target) in enumerate(metrics):
        over_time, cdf = axes[0][column], axes[1][column]
        everything = [getattr(r, key) * scale for r in ok if getattr(r, key) is not None]
        for kind in KINDS:
            points = [(r.start_s, getattr(r, key) * scale) for r in ok
                      if r.kind == kind and getattr(r, key) is not None]
            if points:
                over_time.scatter(*zip(*points), s=14, alpha=0.7, label=kind, **styles[kind])
                _cdf(cdf, [v for _, v in points], color=styles[kind]["color"], label=kind)
        if everything:
            _cdf(cdf, everything, color="black", label="all")
        target_text = f"SLO {target * scale:g} {unit}"
        drawn = bool(everything) and target * scale <= SLO_SHOWN_UP_TO * max(everything)
        for ax in (over_time, cdf):
            if drawn:
                (ax.axhline if ax is over_time else ax.axvline)(target * scale, color="grey", linestyle="--",
                                                                 linewidth=1, label=target_text)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        off_scale = "" if drawn else f" ({target_text}, off the scale)"
        over_time.set(xlabel="request sent at (s)", ylabel=f"{name} ({unit})", title=f"{name} over time{off_scale}")
        cdf.set(xlabel=f"{name} ({unit})", ylabel="fraction of requests", title=f"{name} CDF", ylim=(0, 1.02))
        over_time.set_ylim(bottom=0)
    spec = result.spec
    pacing = f"{spec.concurrency} users" if spec.concurrency else f"Poisson {spec.rate:g} req/s"
    fig.suptitle(title or f"bench serve: {result.model}, {pacing}, {summary['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
