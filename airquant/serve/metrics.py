"""``GET /metrics`` in the Prometheus text format, through ``prometheus_client``.

A custom collector reads ``Provider.metrics()`` at scrape time, so the figures are the provider's own
(no second set of counters to drift), and each app has its own registry (several servers in one
process, as in the tests, do not collide). The server adds what only it sees: rejected requests.
"""

from __future__ import annotations

import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "airquant"

# Provider.metrics() key -> (metric name, help, kind). Keys the provider does not report are skipped.
GAUGES = {
    "queue_depth": ("queue_depth", "Prompts waiting for a weight pass.", "gauge"),
    "running": ("running_sequences", "Sequences in the batch being decoded.", "gauge"),
    "in_flight": ("running_sequences", "Sequences in the batch being decoded.", "gauge"),
    "tokens_per_s": ("tokens_per_second", "New tokens per second of engine time.", "gauge"),
    "passes_per_s": ("passes_per_second", "Forward passes (weight passes) per second.", "gauge"),
    "mean_batch_size": ("mean_batch_size", "Mean prompts per weight pass.", "gauge"),
    "vram_allocated_gb": ("vram_allocated_gigabytes", "GPU memory allocated by torch.", "gauge"),
    "vram_reserved_gb": ("vram_reserved_gigabytes", "GPU memory reserved by torch's allocator.", "gauge"),
    "vram_peak_gb": ("vram_peak_gigabytes", "Peak GPU memory allocated.", "gauge"),
    "uptime_s": ("uptime_seconds", "Seconds since the provider started.", "gauge"),
    "requests": ("requests", "Requests submitted to the provider.", "counter"),
    "requests_failed": ("requests_failed", "Requests whose generation failed.", "counter"),
    "prompts": ("prompts", "Prompts generated.", "counter"),
    "batches": ("batches", "Batches (shared weight passes) run.", "counter"),
    "passes": ("passes", "Forward passes run.", "counter"),
    "new_tokens": ("new_tokens", "New tokens generated.", "counter"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed.", "counter"),
    "busy_s": ("busy_seconds", "Seconds the engine spent generating.", "counter"),
}


class ProviderCollector:
    """Turns one ``metrics()`` snapshot into metric families at each scrape."""

    def __init__(self, provider):
        self.provider = provider

    def collect(self):
        snapshot = self.provider.metrics()
        seen = set()
        for key, (name, doc, kind) in GAUGES.items():
            value = snapshot.get(key)
            if name in seen or not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                continue
            seen.add(name)
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(value))
            yield family
        info = {k: str(v) for k, v in self.provider.describe().items() if v is not None}
        route = GaugeMetricFamily(f"{PREFIX}_route_info", "The route served (store, scheme, mode, KV).",
                                  labels=sorted(info))
        route.add_metric([info[k] for k in sorted(info)], 1.0)
        yield route


class ServerMetrics:
    """The app's registry: the provider's figures plus the server's own rejection counter."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, provider):
        self.registry = CollectorRegistry()
        self.registry.register(ProviderCollector(provider))
        self.rejected = Counter(f"{PREFIX}_http_rejected", "Requests answered with an error status, by status.",
                                ["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware counting error statuses (4xx, 5xx) into ``counter`` by status code."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.counter.labels(status=str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counted)
