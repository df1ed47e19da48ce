"""The agent's Prometheus metrics, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bytes_received = Counter(
            "lorafleet_agent_upload_bytes", "Upload bytes received and written", registry=r
        )
        self.upload_seconds = Histogram(
            "lorafleet_agent_upload_file_seconds",
            "Time to receive and verify one file PUT",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.load_seconds = Histogram(
            "lorafleet_agent_load_seconds",
            "Engine load duration",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.verification_failures = Counter(
            "lorafleet_agent_verification_failures",
            "Uploads or registrations refused by size or digest checks",
            ["reason"],
            registry=r,
        )
        self.reaped_uploads = Counter(
            "lorafleet_agent_reaped_uploads", "Upload sessions reaped after the TTL", registry=r
        )
        self.reconciliations = Counter(
            "lorafleet_agent_reconciliations",
            "Adapters reinstalled into the engine by the reconciler",
            registry=r,
        )
        self.application_checks = Counter(
            "lorafleet_agent_application_checks",
            "Application probes before a cutover, by outcome (applied, unverifiable, not_applied)",
            ["outcome"],
            registry=r,
        )
        self.canary_checks = Counter(
            "lorafleet_agent_canary_checks",
            "Trainer canaries judged before a cutover, by outcome (passed, failed, uninformative)",
            ["outcome"],
            registry=r,
        )
        self.evictions = Counter(
            "lorafleet_agent_evictions",
            "Versions taken out of the engine to make room, their verified files kept",
            registry=r,
        )
        self.relay_hops = Counter(
            "lorafleet_agent_relay_hops",
            "Files forwarded to a peer agent, by the peer's outcome (ok, or its error code, "
            "transport, stalled, aborted)",
            ["outcome"],
            registry=r,
        )
        self.stalled_uploads = Counter(
            "lorafleet_agent_stalled_uploads",
            "Relayed PUTs cut off after their stall limit without a byte",
            registry=r,
        )
        self.store_bytes = Gauge(
            "lorafleet_agent_store_bytes", "Bytes held in the blob store and staging", registry=r
        )
