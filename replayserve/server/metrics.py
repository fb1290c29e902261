"""Prometheus metrics of a server: request and token counters, latency histograms observed as
outputs are published, and the engine's own counters and pool usage read when scraped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "replayserve"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each step for scrapes to read: a scrape never
    touches the engine itself, which only its thread may use.

    usage: the share in use of each pool ("kv_blocks", "mamba_slots", "mamba_cache_states").
    """

    num_running: int = 0
    num_waiting: int = 0
    engine_metrics: dict[str, object] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)


class ServerMetrics:
    """Every metric of one server, in a registry of its own (two servers in one process, as in
    the tests, keep separate counts)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.snapshot = EngineSnapshot()
        labels = {"model_name": model_name}
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests",
                                     labelnames=list(labels), registry=self.registry).labels(**labels)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens sent to clients",
                                         labelnames=list(labels), registry=self.registry).labels(**labels)
        self.finished = Counter(f"{PREFIX}_request_finished", "Completions ended, by finish reason",
                                labelnames=[*labels, "finish_reason"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_request_rejected", "Requests answered 4xx/5xx before generating",
                                labelnames=[*labels, "status"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From arrival to the first token",
                              labelnames=list(labels), buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between a completion's tokens (a step that emits k tokens counts k gaps of 1/k)",
                             labelnames=list(labels), buckets=_ITL_BUCKETS, registry=self.registry).labels(**labels)
        self._labels = labels
        self.registry.register(_EngineCollector(self))

    def finish(self, reason: str) -> None:
        self.finished.labels(finish_reason=reason, **self._labels).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(status=str(status), **self._labels).inc()


class _EngineCollector:
    """Reads the latest `EngineSnapshot` at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap, labels = self._metrics.snapshot, self._metrics._labels
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, key: str) -> Metric:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=names)
            c.add_metric(values, float(snap.engine_metrics.get(key, 0)))  # type: ignore[arg-type]
            return c

        yield gauge("num_requests_running", "Requests in the running batch", snap.num_running)
        yield gauge("num_requests_waiting", "Requests queued for admission", snap.num_waiting)
        usage = GaugeMetricFamily(f"{PREFIX}_cache_usage", "Share of a cache pool in use",
                                  labels=[*names, "pool"])
        for pool, share in snap.usage.items():
            usage.add_metric([*values, pool], share)
        yield usage
        yield counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                      "prefix_cache_queries")
        hits = CounterMetricFamily(f"{PREFIX}_prefix_cache_hits_tokens",
                                   "Prompt tokens found in the prefix cache; group=usable is the hybrid hit "
                                   "(KV and Mamba state both cached)", labels=[*names, "group"])
        for group, key in (("usable", "prefix_cache_hits"), ("attention", "prefix_cache_attention_hits"),
                           ("mamba", "prefix_cache_mamba_hits")):
            hits.add_metric([*values, group], float(snap.engine_metrics.get(key, 0)))  # type: ignore[arg-type]
        yield hits
        yield counter("spec_decode_draft_tokens", "Speculative tokens proposed", "spec_num_draft_tokens")
        yield counter("spec_decode_accepted_tokens", "Speculative tokens accepted", "spec_num_accepted_tokens")
        yield counter("num_preemptions", "Requests preempted (recomputed)", "num_preemptions")
        yield counter("engine_steps", "Engine steps run", "num_steps")
        yield counter("core_time_to_first_token_seconds", "Sum over requests of the engine core's own time to "
                      "first token (queued in the core to the step that produced it)", "core_ttft_seconds_sum")
        yield counter("core_time_to_first_token_requests", "Requests counted in the core's time to first token",
                      "core_ttft_count")
        yield counter("engine_overlapped_steps", "Engine steps launched while the previous step ran "
                      "(async scheduling)", "num_overlapped_steps")
