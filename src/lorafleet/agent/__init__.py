"""The agent: one per engine. Verified streaming uploads, a content-addressed adapter store,
engine loading through the engine's runtime API, and reconciliation after engine restarts.

Its client is ``lorafleet.clients.AsyncAgentClient``."""

__all__: list[str] = []
