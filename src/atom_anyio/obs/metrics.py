"""Prometheus metrics. A fixed set of series: nothing is labelled per
request (unless ``metrics_per_request`` is set, whose series are removed when
their request ends), so rendering ``/metrics`` costs the same after a million
requests as after ten. The engine's state is read when scraped (its ``EngineStats`` record),
never pushed per step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from atom_anyio.engine.stats import EngineStats, SpecStats

disable_created_metrics()  # no *_created series: a fixed set of lines per metric

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# vLLM's names, labels and buckets (vllm/v1/metrics/loggers.py and buckets.py), which routers and
# autoscalers read; one engine, so the label values are fixed at bind time
VLLM_LABELS = ("model_name", "engine")
VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


class StatsSource(Protocol):
    """What the engine gauges read (``Engine``); a protocol, so obs imports no engine."""

    def stats(self) -> EngineStats: ...

    def cache_config_info(self) -> dict[str, str]: ...


class EngineCollector(Collector):
    """Gauges and counters of the engine's stats record, read at scrape time."""

    def __init__(self, engine: StatsSource):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield GaugeMetricFamily("atom_requests_running", "Sequences running", value=s.num_running)
        yield GaugeMetricFamily("atom_requests_waiting", "Sequences waiting", value=s.num_scheduled_waiting)
        yield GaugeMetricFamily("atom_kv_cache_usage_ratio", "Fraction of KV blocks in use", value=s.kv_usage)
        yield GaugeMetricFamily(
            "atom_kv_cache_blocks_free", "Free KV blocks (cached ones included)", value=s.num_free_blocks
        )
        yield GaugeMetricFamily("atom_kv_cache_blocks_total", "KV blocks in the pool", value=s.num_blocks)
        yield CounterMetricFamily(
            "atom_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", value=s.num_prefix_hit_tokens
        )
        yield GaugeMetricFamily(
            "atom_kv_cache_blocks_leased",
            "Cached blocks kept for a conversation's next turn",
            value=s.num_leased_blocks,
        )
        yield CounterMetricFamily(
            "atom_prefix_cache_leased_hit_tokens",
            "Prompt tokens served from leased blocks",
            value=s.num_leased_hit_tokens,
        )
        yield CounterMetricFamily("atom_preemptions", "Sequences preempted (recompute)", value=s.num_preemptions)
        yield GaugeMetricFamily(
            "atom_sequences_alive", "Sequence objects alive in the process", value=s.num_sequences_alive
        )
        if (t := s.tier) is not None:
            yield GaugeMetricFamily(
                "atom_kv_tier_blocks_total", "Blocks the second KV tier holds at most", t.num_blocks
            )
            yield GaugeMetricFamily("atom_kv_tier_blocks_used", "Blocks in the second KV tier", t.num_used_blocks)
            yield CounterMetricFamily(
                "atom_kv_tier_saved_blocks", "Blocks evicted from the pool and saved to the tier", t.num_saved_blocks
            )
            yield CounterMetricFamily(
                "atom_kv_tier_restored_blocks", "Blocks restored from the tier into the pool", t.num_restored_blocks
            )
            yield CounterMetricFamily(
                "atom_prefix_cache_tier_hit_tokens", "Prompt tokens restored from the second tier", t.num_hit_tokens
            )
            yield HistogramMetricFamily(
                "atom_kv_tier_copy_seconds",
                "Per step that copied blocks to or from the second tier: the copies' time (the step waits for them)",
                buckets=t.copy_seconds.cumulative(),
                sum_value=t.copy_seconds.sum,
            )
        if (steps := s.step_seconds) is not None:
            yield HistogramMetricFamily(
                "atom_engine_step_seconds",
                "The worker's time per step: the tier's copies, the forward and the sampling",
                buckets=steps.cumulative(),
                sum_value=steps.sum,
            )
        if s.num_kv_events_dropped is not None:
            yield CounterMetricFamily(
                "atom_kv_events_dropped", "KV event batches dropped (queue full)", value=s.num_kv_events_dropped
            )


class VllmEngineCollector(Collector):
    """The engine's stats under vLLM's names and labels."""

    def __init__(self, engine: StatsSource, labels: list[str]):
        self.engine, self.labels = engine, labels

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for kind, name, doc, value in (
            (gauge, "vllm:num_requests_running", "Requests in the running batch", s.num_running),
            (gauge, "vllm:num_requests_waiting", "Requests waiting to be processed", s.num_waiting_seqs),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", s.kv_usage),
            (counter, "vllm:prefix_cache_queries", "Prefix cache queries, in tokens", s.num_prefix_queried_tokens),
            (counter, "vllm:prefix_cache_hits", "Prefix cache hits, in tokens", s.num_prefix_hit_tokens),
            (counter, "vllm:num_preemptions", "Preemptions", s.num_preemptions),
        ):
            family = kind(name, doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, value)
            yield family
        if (t := s.tier) is not None:  # vLLM counts a KV connector's (its offloading's) hits as external
            for name, doc, value in (
                (
                    "vllm:external_prefix_cache_queries",
                    "External prefix cache queries, in tokens",
                    t.num_queried_tokens,
                ),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens", t.num_hit_tokens),
            ):
                family = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
                family.add_metric(self.labels, value)
                yield family
        if s.spec is not None:
            yield from self._spec_decode(s.spec)

    def _spec_decode(self, spec: SpecStats) -> Iterator[Metric]:
        """Speculative decoding's counters, as vLLM's SpecDecodingProm names them."""
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, value)
            yield family
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft (speculative token) position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for position, value in enumerate(spec.num_accepted_per_pos):
            per_pos.add_metric([*self.labels, str(position)], value)
        yield per_pos


class Admitting(Protocol):
    """What the admission gauges read (the server's runtime); a protocol, so obs imports no api."""

    config: Any
    num_waiting_seqs: int
    num_waiting_tokens: int
    num_in_flight: int


class AdmissionCollector(Collector):
    """The waiting queue admission bounds, and its limits."""

    def __init__(self, server: Admitting):
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server, cfg = self.server, self.server.config
        yield GaugeMetricFamily(
            "atom_queue_waiting_seqs", "Sequences admitted and not yet running", value=server.num_waiting_seqs
        )
        yield GaugeMetricFamily(
            "atom_queue_waiting_tokens", "Prompt tokens of the waiting sequences", value=server.num_waiting_tokens
        )
        yield GaugeMetricFamily("atom_queue_max_waiting_seqs", "Admission limit", value=cfg.max_waiting_seqs)
        yield GaugeMetricFamily("atom_queue_max_waiting_tokens", "Admission limit", value=cfg.max_waiting_tokens)
        yield GaugeMetricFamily(
            "atom_requests_in_flight", "Requests admitted and not finished", value=server.num_in_flight
        )


class Metrics:
    def __init__(self, per_request: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "atom_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("atom_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("atom_generation_tokens", "Generated tokens", registry=r)
        self.segment_cache_hits = Counter(
            "atom_segment_cache_hit_tokens", "Prompt tokens taken from the segment cache", registry=r
        )
        self.ttft = Histogram(
            "atom_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram("atom_inter_token_latency_seconds", "Time between deltas", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("atom_e2e_request_latency_seconds", "End to end", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "atom_request_queue_time_seconds", "Waiting for a first step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prepare_seconds = Histogram(
            "atom_prepare_prompt_seconds", "Time in prepare_prompt", buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_prompt_tokens = Histogram(
            "atom_request_prompt_tokens", "Prompt length", buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "atom_request_generation_tokens", "Generated tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.loop_lag = Histogram(
            "atom_event_loop_lag_seconds", "Event-loop scheduling delay", buckets=LAG_BUCKETS, registry=r
        )
        self.rejected = Counter(
            "atom_requests_rejected", "Requests refused at admission, by reason", ["reason"], registry=r
        )
        self.closed_early = Counter(
            "atom_structured_closed_early",
            "Constrained outputs whose grammar was closed early to end within max_tokens",
            registry=r,
        )
        self.gc_pause = Histogram("atom_gc_pause_seconds", "GC pauses", ["generation"], buckets=GC_BUCKETS, registry=r)
        self.context_tokens = (
            Gauge("atom_request_context_tokens", "Context tokens of a running request", ["request_id"], registry=r)
            if per_request
            else None
        )
        self.vllm: VllmSeries | None = None

    def bind_engine(self, engine: StatsSource, model_name: str) -> None:
        self.registry.register(EngineCollector(engine))
        labels = [model_name, "0"]
        self.registry.register(VllmEngineCollector(engine, labels))
        self.vllm = VllmSeries(self.registry, labels)
        # vLLM's info series: a gauge at 1 whose labels are the KV cache's configuration (no model_name, as vLLM's)
        info = {**engine.cache_config_info(), "engine": "0"}
        gauge = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info), registry=self.registry
        )
        gauge.labels(**info).set(1)

    def bind_admission(self, server: Admitting) -> None:
        self.registry.register(AdmissionCollector(server))

    def request_started(self, request_id: str | None, prompt_tokens: int, segment_hits: int) -> None:
        self.segment_cache_hits.inc(segment_hits)
        if self.context_tokens is not None and request_id:
            self.context_tokens.labels(request_id).set(prompt_tokens)

    def observe_finished(self, endpoint: str, outcome: str, usage, request_id: str | None = None) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.closed_early.inc(usage.num_closed_early)
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_generation_tokens.observe(usage.completion_tokens)
        for name, hist in (("ttft", self.ttft), ("e2e", self.e2e), ("queue_time", self.queue_time)):
            if name in usage.timings:
                hist.observe(usage.timings[name])
        for gap in usage.inter_token_gaps:
            self.itl.observe(gap)
        if self.vllm is not None:
            self.vllm.observe_finished(usage)
        if self.context_tokens is not None and request_id:
            with contextlib.suppress(KeyError):  # never started (refused before prepare)
                self.context_tokens.remove(request_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmSeries:
    """Request counters and histograms under vLLM's names, one labelled child each."""

    def __init__(self, r: CollectorRegistry, labels: list[str]):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, VLLM_LABELS, registry=r).labels(*labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", VLLM_TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between deltas", VLLM_ITL_BUCKETS)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Decode time per output token, per request", VLLM_ITL_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End to end", VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Waiting for a first step", VLLM_REQUEST_LATENCY_BUCKETS
        )

    def observe_finished(self, usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        t = usage.timings
        for name, hist in (("ttft", self.ttft), ("e2e", self.e2e), ("queue_time", self.queue_time)):
            if name in t:
                hist.observe(t[name])
        for gap in usage.inter_token_gaps:
            self.itl.observe(gap)
        if "ttft" in t and "e2e" in t and usage.completion_tokens > 1:
            self.tpot.observe((t["e2e"] - t["ttft"]) / (usage.completion_tokens - 1))
