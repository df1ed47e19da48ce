"""The reference engine's Prometheus series (``/metrics``), in their own registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from lorafleet.engine._runtime import GenResult

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """Requests by route and model, tokens by model, and the number of registered adapters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lorafleet_engine_requests",
            "Requests by route and requested model.",
            ["route", "model"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "lorafleet_engine_generation_tokens",
            "Generated tokens by model.",
            ["model"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "lorafleet_engine_prompt_tokens",
            "Prompt tokens by model.",
            ["model"],
            registry=self.registry,
        )
        self.adapters_loaded = Gauge(
            "lorafleet_engine_adapters_loaded",
            "LoRA adapters currently registered.",
            registry=self.registry,
        )

    def account(self, model: str, result: GenResult) -> None:
        """Count one finished generation's prompt and generated tokens under ``model``."""
        self.prompt_tokens.labels(model).inc(result.prompt_tokens)
        self.generation_tokens.labels(model).inc(len(result.token_ids))
