"""SGLang's runtime LoRA API: ``/load_lora_adapter`` and ``/unload_lora_adapter``.

Both answer ``{success, error_message, loaded_adapters}``, 200 on success and 400 on failure
(research/sglang-and-miles.md §1.2). A plain load never replaces a loaded name; Miles' SGLang
accepts ``upsert: true`` (opt in with ``--sglang-upsert``). Without it an in-place update is
unload-then-load, which is NOT atomic: requests between the two calls find no adapter.
Adapters are listed from ``/v1/models`` (cards whose ``parent`` is set), falling back to the
``loaded_adapters`` map of a no-op unload where an engine does not list them.
"""

from __future__ import annotations

import contextlib

from lorafleet._http import error_message
from lorafleet.agent.backends.base import (
    AdapterMissing,
    EngineBackend,
    EngineProbe,
    EngineRejected,
    EngineUnavailable,
    json_dict,
    map_transport,
)
from lorafleet.protocol.agent import EngineCapabilities

__all__ = ["SGLangBackend"]


class SGLangBackend(EngineBackend):
    kind = "sglang"

    def __init__(
        self,
        url: str,
        *,
        upsert: bool = False,
        max_lora_rank: int | None = None,
        max_adapters: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(url, timeout=timeout)
        self.upsert = upsert
        self.max_lora_rank = max_lora_rank
        self.max_adapters = max_adapters

    async def probe(self) -> EngineProbe:
        base = None
        for card in await self._models():
            if not card.get("parent"):
                base = str(card["id"])
                break
        caps = EngineCapabilities(
            kind="sglang",
            max_lora_rank=self.max_lora_rank,
            max_adapters=self.max_adapters,
            upsert=self.upsert,
            unload_frees_slot=True,
        )
        return EngineProbe(base_model=base or "unknown", capabilities=caps)

    async def list_adapters(self) -> dict[str, str]:
        return {
            str(c["id"]): str(c.get("root") or "") for c in await self._models() if c.get("parent")
        }

    async def _post(self, route: str, body: dict) -> dict:
        with map_transport(self.url):
            r = await self.http.post(route, json=body)
        data = json_dict(r)
        if r.status_code == 404 and data.get("detail") == "Not Found":
            raise EngineUnavailable(
                f"the engine has no {route} route (start it with --enable-lora)"
            )
        if r.status_code == 200 and data.get("success", True):
            return data
        if r.status_code >= 500:
            raise EngineUnavailable(f"{route} answered {r.status_code}: {error_message(r)}")
        return {"success": False, "error_message": error_message(r), "status": r.status_code}

    async def load(self, name: str, path: str, *, replace: bool = False) -> None:
        body: dict = {"lora_name": name, "lora_path": path}
        if replace and self.upsert:
            body["upsert"] = True
        elif replace:
            # Not atomic (documented): SGLang refuses to load over a loaded name.
            with contextlib.suppress(AdapterMissing):
                await self.unload(name)
        data = await self._post("/load_lora_adapter", body)
        if not data.get("success", True) and "already loaded" in str(data.get("error_message")):
            # A lost answer to an earlier load of the same name and path: already done.
            with contextlib.suppress(EngineUnavailable):
                held = await self.list_adapters()
                if name in held and held[name] in ("", path):
                    return
        if not data.get("success", True):
            raise EngineRejected(
                f"SGLang refused to load {name!r}: {data.get('error_message')}", data.get("status")
            )

    async def unload(self, name: str) -> None:
        data = await self._post("/unload_lora_adapter", {"lora_name": name})
        if not data.get("success", True):
            msg = str(data.get("error_message") or "")
            if "not exist" in msg or "not found" in msg.lower() or "not loaded" in msg:
                raise AdapterMissing(msg)
            raise EngineRejected(f"SGLang refused to unload {name!r}: {msg}", data.get("status"))
