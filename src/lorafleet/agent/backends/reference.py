"""The embedded reference engine (``lorafleet engine``): vLLM's dialect plus ``/v1/engine_info``.

``GET /v1/engine_info`` -> ``{"model", "max_loras", "max_lora_rank", "adapters"}`` tells the agent
the engine's real limits, so the agent refuses what the engine would refuse before loading. It
keeps no prefix cache (each request runs whole), so a reset has nothing to do.
"""

from __future__ import annotations

from lorafleet._http import error_message
from lorafleet.agent.backends.base import (
    EngineProbe,
    EngineUnavailable,
    PrefixCacheReset,
    json_dict,
    map_transport,
)
from lorafleet.agent.backends.vllm import VLLMBackend
from lorafleet.protocol.agent import EngineCapabilities

__all__ = ["ReferenceBackend"]


class ReferenceBackend(VLLMBackend):
    kind = "reference"

    async def probe(self) -> EngineProbe:
        with map_transport(self.url):
            r = await self.http.get("/v1/engine_info", timeout=5.0)
        if r.status_code != 200:
            raise EngineUnavailable(
                f"GET /v1/engine_info answered {r.status_code}: {error_message(r)}"
            )
        info = json_dict(r)
        if not info:
            raise EngineUnavailable(
                f"GET /v1/engine_info answered no JSON object: {r.text[:200]!r}"
            )
        caps = EngineCapabilities(
            kind="reference",
            max_lora_rank=self.max_lora_rank or info.get("max_lora_rank"),
            max_adapters=self.max_adapters or info.get("max_loras"),
            upsert=True,
            unload_frees_slot=True,
        )
        return EngineProbe(base_model=str(info.get("model") or "unknown"), capabilities=caps)

    async def reset_prefix_cache(self, reset_running_requests: bool) -> PrefixCacheReset:
        return PrefixCacheReset("no_prefix_cache")
