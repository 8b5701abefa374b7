"""Prometheus metrics. A fixed set of series: nothing is labelled per
request, so rendering ``/metrics`` costs the same after a million requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

if TYPE_CHECKING:
    from atom_anyio.engine.loop import Engine

disable_created_metrics()  # no *_created series: a fixed set of lines per metric

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "atom_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("atom_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("atom_generation_tokens", "Generated tokens", registry=r)
        self.prepare_seconds = Histogram(
            "atom_prepare_prompt_seconds", "Time in prepare_prompt", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram("atom_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("atom_e2e_request_latency_seconds", "End to end", buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("atom_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("atom_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("atom_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.kv_free = Gauge("atom_kv_cache_blocks_free", "Free KV blocks", registry=r)
        self.prefix_hits = Gauge(
            "atom_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )

    def bind_engine(self, engine: Engine) -> None:
        """Gauges read the engine when scraped; nothing is pushed per step."""
        sched, bm = engine.scheduler, engine.block_manager
        self.running.set_function(lambda: len(sched.running))
        self.waiting.set_function(lambda: len(sched.waiting))
        self.kv_usage.set_function(lambda: bm.usage)
        self.kv_free.set_function(lambda: bm.num_free_blocks)
        self.prefix_hits.set_function(lambda: bm.num_hit_tokens)

    def observe_finished(
        self, endpoint: str, outcome: str, prompt_tokens: int, output_tokens: int, timings: dict
    ) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if "ttft" in timings:
            self.ttft.observe(timings["ttft"])
        if "e2e" in timings:
            self.e2e.observe(timings["e2e"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
