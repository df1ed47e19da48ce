"""The router: OpenAI-compatible front door that routes by adapter version."""
