"""Prometheus metrics of the server (GET /metrics), with vLLM's metric names under the `hybridmoe:` prefix.

Per request, recorded when it ends (finished, aborted or failed; `ServerMetrics.on_request_finished`, called on
the engine thread):
  hybridmoe:time_to_first_token_seconds      histogram: from the engine taking the request to its first token
  hybridmoe:time_per_output_token_seconds    histogram: the request's mean time per token after the first
  hybridmoe:e2e_request_latency_seconds      histogram: from the engine taking the request to its end
  hybridmoe:prompt_tokens_total, hybridmoe:generation_tokens_total   counters
  hybridmoe:request_success_total{finished_reason="stop"|"length"|"abort"|"error"}   counter
From the engine's scheduler, read at each scrape (`SchedulerStats`):
  hybridmoe:num_requests_running, hybridmoe:num_requests_waiting    gauges
  hybridmoe:kv_blocks_used, hybridmoe:kv_blocks_free, hybridmoe:kv_blocks_total, and
  hybridmoe:kv_cache_usage_perc (used / total, 0..1)                gauges
  hybridmoe:prefix_cache_queries_total, hybridmoe:prefix_cache_hits_total (tokens), and
  hybridmoe:prefix_cache_hit_rate (hits / queries since the start)   counters, gauge
  hybridmoe:num_preemptions_total, hybridmoe:computed_tokens_total   counters
From the engine's RunStats (what ran where, docs/hybrid.md), read at each scrape once the model is loaded:
  hybridmoe:accelerator_bytes{kind="attention"|"kv cache"|"router"|"shared"|"dense"|"lm_head"|"hot experts"|...}
  and hybridmoe:accelerator_peak_bytes                                gauges: bytes held on the accelerator
  hybridmoe:engine_steps_total{phase="prefill"|"decode"}, hybridmoe:engine_tokens_total{phase},
  hybridmoe:engine_step_seconds_total{phase} (decode throughput = decode tokens / decode step seconds),
  hybridmoe:accelerator_seconds_total{phase}, hybridmoe:cpu_experts_seconds_total{phase} (submit until the CPU
  kernels' result is in hand), hybridmoe:cpu_experts_wait_seconds_total{phase} (of that, time the forward waited),
  hybridmoe:expert_assignments_total{phase, where="cpu"|"accelerator"}   counters (per step: divide by steps)
  hybridmoe:streamed_bytes_total{phase}, hybridmoe:stream_copy_seconds_total{phase}   counters: stream-loading
  prefill's copies (achieved GB/s = bytes / seconds), and hybridmoe:stream_copy_gbs (over all so far)   gauge
Every series carries the label model_name. One registry per server, so several servers live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridmoe.accel.stats import RunStats
from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.runtime.scheduler import SchedulerStats

PREFIX = "hybridmoe:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets: a CPU engine spans from milliseconds (decode of a small model) to minutes (a long prefill)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None],
                 run_stats: Callable[[], RunStats | None] | None = None):
        """stats: the engine's latest SchedulerStats (None while the model loads); run_stats: the engine's RunStats
        (None while it loads)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels, reg = ["model_name"], self.registry
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                               buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self._tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the "
                               "first, per request", labels, buckets=_TPOT_BUCKETS, registry=reg).labels(model_name)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency", labels,
                              buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self._prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels,
                                      registry=reg).labels(model_name)
        self._generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests",
                                          labels, registry=reg).labels(model_name)
        self._outcomes = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                 labels + ["finished_reason"], registry=reg)
        for reason in ("stop", "length", "abort", "error"):  # present at 0 from the start
            self._outcomes.labels(model_name, reason)
        reg.register(_SchedulerCollector(model_name, stats))
        if run_stats is not None:
            reg.register(_RunStatsCollector(model_name, run_stats))

    def on_request_finished(self, out: RequestOutput) -> None:
        now = time.monotonic()
        num_generated = len(out.token_ids)
        self._prompt_tokens.inc(len(out.prompt_token_ids))
        self._generation_tokens.inc(num_generated)
        self._outcomes.labels(self.model_name, out.finish_reason or "error").inc()
        self._e2e.observe(now - out.arrival_time)
        if out.first_token_time is not None:
            self._ttft.observe(out.first_token_time - out.arrival_time)
            if num_generated > 1:
                self._tpot.observe((now - out.first_token_time) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    """Reads the engine's SchedulerStats at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None]):
        self.model_name, self.stats = model_name, stats

    def collect(self):
        stats = self.stats()
        if stats is None:
            return

        def family(kind, name: str, documentation: str, value: float):
            metric = kind(PREFIX + name, documentation, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            return metric

        yield family(GaugeMetricFamily, "num_requests_running", "Requests running in the engine",
                     stats.num_running_requests)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting (queued or preempted)",
                     stats.num_waiting_requests)
        yield family(GaugeMetricFamily, "kv_blocks_used", "KV cache blocks held by requests", stats.kv_blocks_used)
        yield family(GaugeMetricFamily, "kv_blocks_free", "KV cache blocks no request holds (cached ones included)",
                     stats.kv_blocks_free)
        yield family(GaugeMetricFamily, "kv_blocks_total", "KV cache blocks", stats.kv_blocks_total)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV cache usage (used / total blocks, 0..1)",
                     stats.kv_blocks_used / stats.kv_blocks_total)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Tokens looked up in the prefix cache",
                     stats.prefix_cache_queries)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Tokens found in the prefix cache",
                     stats.prefix_cache_hits)
        yield family(GaugeMetricFamily, "prefix_cache_hit_rate", "Prefix cache hits / queries since the start",
                     stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0)
        yield family(CounterMetricFamily, "num_preemptions", "Requests preempted for KV blocks",
                     stats.num_preemptions)
        yield family(CounterMetricFamily, "computed_tokens", "Tokens the model computed", stats.computed_tokens)


class _RunStatsCollector:
    """Reads the engine's RunStats (what ran where) at each scrape."""

    def __init__(self, model_name: str, run_stats: Callable[[], RunStats | None]):
        self.model_name, self.run_stats = model_name, run_stats

    def collect(self):
        stats = self.run_stats()
        if stats is None:
            return
        name = self.model_name
        held = GaugeMetricFamily(PREFIX + "accelerator_bytes", "Bytes held on the accelerator, by kind",
                                 labels=["model_name", "kind"])
        for kind, nbytes in sorted(stats.device_bytes_by_kind().items()):
            held.add_metric([name, kind], nbytes)
        yield held
        peak = GaugeMetricFamily(PREFIX + "accelerator_peak_bytes", "Most bytes held on the accelerator at once",
                                 labels=["model_name"])
        peak.add_metric([name], getattr(stats.ledger, "peak", 0))
        yield peak
        per_phase = (("engine_steps", "Engine steps", "steps"),
                     ("engine_tokens", "Tokens the engine's steps computed", "tokens"),
                     ("engine_step_seconds", "Wall time of the engine's steps", "step_s"),
                     ("accelerator_seconds", "Time of the work issued on the accelerator", "accel_s"),
                     ("cpu_experts_seconds", "CPU expert kernels, from submit until their result was in hand",
                      "cpu_experts_s"),
                     ("cpu_experts_wait_seconds", "Time the forward waited for the CPU expert kernels", "cpu_wait_s"),
                     ("streamed_bytes", "Bytes stream-loading prefill copied to the accelerator", "bytes_streamed"),
                     ("stream_copy_seconds", "Time stream-loading prefill's copies took", "copy_s"))
        for metric, documentation, attribute in per_phase:
            family = CounterMetricFamily(PREFIX + metric, documentation, labels=["model_name", "phase"])
            for phase, totals in stats.phases.items():
                family.add_metric([name, phase], getattr(totals, attribute))
            yield family
        assignments = CounterMetricFamily(PREFIX + "expert_assignments", "(token, expert) pairs computed, by where",
                                          labels=["model_name", "phase", "where"])
        for phase, totals in stats.phases.items():
            assignments.add_metric([name, phase, "cpu"], totals.cpu_expert_assignments)
            assignments.add_metric([name, phase, "accelerator"], totals.hot_expert_assignments)
        yield assignments
        copied = sum(t.bytes_streamed for t in stats.phases.values())
        seconds = sum(t.copy_s for t in stats.phases.values())
        gbs = GaugeMetricFamily(PREFIX + "stream_copy_gbs", "Achieved copy bandwidth of stream-loading prefill, GB/s",
                                labels=["model_name"])
        gbs.add_metric([name], copied / seconds / 1e9 if seconds > 0 else 0.0)
        yield gbs
