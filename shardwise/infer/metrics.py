"""The server's Prometheus metrics (`GET /metrics`), on a registry of its own (one per app, so
that several servers in one process, as in the tests, do not share counts)."""

from __future__ import annotations

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.requests = Counter("shardwise_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.latency = Histogram("shardwise_request_latency_seconds", "time from request to the end of its answer",
                                 ["route"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.first_token = Histogram("shardwise_time_to_first_token_seconds", "time from submission to the "
                                     "first generated token", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("shardwise_prompt_tokens", "prompt tokens submitted", registry=registry)
        self.generated_tokens = Counter("shardwise_generated_tokens", "tokens generated", registry=registry)
        self.rejected = Counter("shardwise_rejected_requests", "requests answered 429 (queue full)",
                                registry=registry)
        Gauge("shardwise_queue_depth", "sequences waiting for a slot",
              registry=registry).set_function(engine.num_waiting)
        Gauge("shardwise_running_sequences", "sequences holding a slot",
              registry=registry).set_function(engine.num_running)
        Gauge("shardwise_slots", "sequences the engine runs at once", registry=registry).set(engine.max_batch)
        if engine.prefix_cache is not None:
            registry.register(PrefixCacheCollector(engine.prefix_cache))
        registry.register(SpeculationCollector(engine))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """Streaming answers are timed to their first byte here; the token histograms time generation."""
        route = route if route.startswith("/v1/") else "other"
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class PrefixCacheCollector:
    """The prefix cache's counts (`PrefixCache.counts`), read when /metrics is scraped: sequences that
    reused a cached prefix (hits) or not (misses), prompt tokens reused, blocks evicted, bytes held."""

    def __init__(self, prefix_cache):
        self.prefix_cache = prefix_cache

    def describe(self):
        return []  # nothing to check at registration: the names are fixed below

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counts = self.prefix_cache.counts()
        for name, help_text in (("hits", "sequences whose prompt started with a cached prefix"),
                                ("misses", "sequences whose prompt found no cached prefix"),
                                ("reused_tokens", "prompt tokens whose keys and values came from the prefix cache"),
                                ("evicted_blocks", "cached blocks evicted (least recently used) to make room")):
            yield CounterMetricFamily(f"shardwise_prefix_cache_{name}", help_text, value=counts[name])
        yield GaugeMetricFamily("shardwise_prefix_cache_bytes", "bytes of the prefix cache holding blocks",
                                value=counts["bytes_used"])
        yield GaugeMetricFamily("shardwise_prefix_cache_limit_bytes", "the prefix cache's bound "
                                "(--prefix-cache-mb), per process", value=counts["bytes_limit"])


class SpeculationCollector:
    """Speculative decoding's counts, read from the engine's stats at each scrape (zero without
    --speculate): draft tokens proposed and accepted, and the acceptance rate so far."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        proposed = self.engine.stats["draft_tokens_proposed"]
        accepted = self.engine.stats["draft_tokens_accepted"]
        yield CounterMetricFamily("shardwise_draft_tokens_proposed", "draft tokens proposed for verification "
                                  "(--speculate)", value=proposed)
        yield CounterMetricFamily("shardwise_draft_tokens_accepted", "draft tokens the model accepted", value=accepted)
        yield GaugeMetricFamily("shardwise_draft_acceptance_rate", "accepted / proposed draft tokens so far "
                                "(0 before any proposal)", value=accepted / proposed if proposed else 0.0)
