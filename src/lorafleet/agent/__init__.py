"""The agent: one per engine. Verified streaming uploads, a content-addressed adapter store,
engine loading through the engine's runtime API, and reconciliation after engine restarts."""

from __future__ import annotations

from lorafleet.agent.client import AsyncAgentClient

__all__ = ["AsyncAgentClient"]
