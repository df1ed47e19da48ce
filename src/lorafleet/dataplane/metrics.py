"""Prometheus metrics for the router, with label children cached off the hot path."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """Requests and latency by adapter and version, in-flight gauges, replica health."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lorafleet_router_requests",
            "Routed requests by adapter, version and status",
            ["adapter", "version", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "lorafleet_router_request_seconds",
            "Routed request latency (to the last byte) by adapter and version",
            ["adapter", "version"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "lorafleet_router_inflight",
            "Requests in flight by adapter and version",
            ["adapter", "version"],
            registry=self.registry,
        )
        self.replica_healthy = Gauge(
            "lorafleet_router_replica_healthy",
            "1 when the replica is in rotation",
            ["replica"],
            registry=self.registry,
        )
        self.replica_inflight = Gauge(
            "lorafleet_router_replica_inflight",
            "Requests in flight per replica",
            ["replica"],
            registry=self.registry,
        )
        self.sessions = Gauge(
            "lorafleet_router_sessions",
            "Sessions remembered (their sticky replica and version pins), set at scrape",
            registry=self.registry,
        )
        self.retries = Counter(
            "lorafleet_router_retries",
            "Requests re-sent to another replica after a connection failure",
            registry=self.registry,
        )
        self.stale_retries = Counter(
            "lorafleet_router_stale_connection_retries",
            "Requests re-sent on a fresh connection after a pooled one failed before any answer",
            registry=self.registry,
        )
        self.panic = Counter(
            "lorafleet_router_panic_routed",
            "Requests sent to replicas that looked unhealthy, because no healthy one held the "
            "version",
            registry=self.registry,
        )
        self.version_lag = Histogram(
            "lorafleet_router_version_lag",
            "Versions between the one that served a request and the name's newest (pins and "
            "sessions on older versions of the retention window)",
            ["adapter"],
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.lagging = Gauge(
            "lorafleet_router_replica_lagging",
            "1 while the replica does not hold the name's newest version (quorum publication, "
            "catch-up pending); the value of lagging_since is the first version it missed",
            ["adapter", "replica"],
            registry=self.registry,
        )
        self.lagging_since = Gauge(
            "lorafleet_router_replica_lagging_since_version",
            "The first version of the name the lagging replica missed",
            ["adapter", "replica"],
            registry=self.registry,
        )
        self.canary_delta = Gauge(
            "lorafleet_router_canary_delta",
            "The trainer's canary on each replica of each routable version: mean or max |delta "
            "log p| of the engine's answer against the trainer's adapter or against the base",
            ["adapter", "version", "replica", "against", "stat"],
            registry=self.registry,
        )
        self.canary_passed = Gauge(
            "lorafleet_router_canary_passed",
            "1 when the replica's engine passed the version's canary, 0 when it failed, -1 when "
            "the canary could not tell the adapter from the base (uninformative)",
            ["adapter", "version", "replica"],
            registry=self.registry,
        )
        self.on_demand_loads = Counter(
            "lorafleet_router_on_demand_loads",
            "Versions loaded on a replica because requests asked for them, by why (cold: held "
            "nowhere; more: its replicas' queues grew) and outcome (ok, failed)",
            ["why", "outcome"],
            registry=self.registry,
        )
        self.cold_start = Histogram(
            "lorafleet_router_cold_start_seconds",
            "From a request for a cold version to the version listed on a replica",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.evictions = Counter(
            "lorafleet_router_evictions",
            "Versions evicted from a replica to make room (least recently used, drained first)",
            registry=self.registry,
        )
        self.catch_up_trees = Counter(
            "lorafleet_router_catch_up_trees",
            "Relay trees catch-up fed lagging replicas through (several replicas that needed "
            "one version at once, from one peer each)",
            registry=self.registry,
        )
        self.shrinks = Counter(
            "lorafleet_router_idle_shrinks",
            "Replicas a version was loaded on on demand, evicted again after it stayed idle for "
            "--shrink-after seconds",
            registry=self.registry,
        )
        self.holders = Gauge(
            "lorafleet_router_version_replicas",
            "Replicas holding each routable version (0: cold, loaded on the next request)",
            ["adapter", "version"],
            registry=self.registry,
        )
        self.catch_ups = Counter(
            "lorafleet_router_catch_ups",
            "Catch-ups of a replica from a peer agent, by outcome (ok, failed)",
            ["outcome"],
            registry=self.registry,
        )
        self._lags: dict[str, Histogram] = {}
        self._children: dict[tuple, tuple] = {}
        self._counters: dict[tuple, Counter] = {}

    def children(self, adapter: str | None, version: int | None) -> tuple:
        """(latency histogram, in-flight gauge) for this key, cached."""
        key = (adapter, version)
        got = self._children.get(key)
        if got is None:
            a, v = adapter or "", "" if version is None else str(version)
            got = self._children[key] = (self.latency.labels(a, v), self.inflight.labels(a, v))
        return got

    def lag(self, adapter: str) -> Histogram:
        """The version-lag histogram child for ``adapter``, cached."""
        h = self._lags.get(adapter)
        if h is None:
            h = self._lags[adapter] = self.version_lag.labels(adapter)
        return h

    def forget(self, adapter: str, version: int) -> None:
        """Drop a retired version's series: a run that publishes every step would otherwise
        grow every scrape without bound."""
        a, v = adapter, str(version)
        if self._children.pop((adapter, version), None) is not None:
            self.latency.remove(a, v)
            self.inflight.remove(a, v)
        for key in [k for k in self._counters if k[:2] == (adapter, version)]:
            del self._counters[key]
            self.requests.remove(a, v, str(key[2]))

    def count(self, adapter: str | None, version: int | None, status: int) -> None:
        key = (adapter, version, status)
        c = self._counters.get(key)
        if c is None:
            a, v = adapter or "", "" if version is None else str(version)
            c = self._counters[key] = self.requests.labels(a, v, str(status))
        c.inc()
