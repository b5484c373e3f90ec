"""The proxy's Prometheus metrics (GET /metrics): request latency, journal commits, garbage collections and the staleness of
leased groups as histograms, observed as they happen; the state's counters and gauges read only when scraped."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REGISTRY = CollectorRegistry()
LATENCY = Histogram("proxy_request_seconds", "request latency by route", ["method", "route"], registry=REGISTRY,
                    buckets=(.001, .0025, .005, .01, .025, .05, .1, .15, .25, .5, 1, 2.5, 5, 10, 30, 60))  # .15: the p99 target
COMMIT = Histogram("proxy_journal_commit_seconds", "one group-commit write to the bucket", registry=REGISTRY,
                   buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
GC_PAUSE = Histogram("proxy_gc_pause_seconds", "one cyclic garbage collection (sweeper.py)", registry=REGISTRY,
                     buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5))
STALENESS = Histogram("proxy_lease_staleness_versions", "staleness of leased groups (latest - policy_version)",
                      registry=REGISTRY, buckets=(0, 1, 2, 3, 4, 6, 8, 16))
MEDIA_TYPE = CONTENT_TYPE_LATEST


def observe_request(scope: dict, seconds: float) -> None:
    """One answered request (the access guard times every one), by its route's path template."""
    LATENCY.labels(scope["method"], getattr(scope.get("route"), "path", "other")).observe(seconds)


class StateCollector:
    """The state's numbers at scrape time: `counters()` and `gauges()` (name -> value, each exported as
    proxy_<name>) and the metric families `more()` yields (per participant, per quarantine)."""

    def __init__(self, counters: Callable[[], dict], gauges: Callable[[], dict], more: Callable[[], Iterable]):
        self.counters, self.gauges, self.more = counters, gauges, more

    def collect(self):
        yield from (CounterMetricFamily(f"proxy_{k}", k.replace("_", " "), value=v) for k, v in self.counters().items())
        yield from (GaugeMetricFamily(f"proxy_{k}", k.replace("_", " "), value=v) for k, v in self.gauges().items())
        yield from self.more()


def install(counters: Callable[[], dict], gauges: Callable[[], dict], more: Callable[[], Iterable]) -> None:
    REGISTRY.register(StateCollector(counters, gauges, more))


def exposition() -> bytes:
    """The Prometheus text format of everything above."""
    return generate_latest(REGISTRY)
