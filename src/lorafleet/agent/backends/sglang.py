"""SGLang's runtime LoRA API: ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/v1/models``.

Facts this relies on, observed on SGLang 0.5.23 (docs/engines/sglang.md):

- both routes answer ``{success, error_message, loaded_adapters}``: 200 on success, **400** on any
  failure, told apart by the message (``... because it is already loaded``, ``LoRA with name X does
  not exist. Loaded LoRAs: ...``, ``... incompatible with the current LoRA memory pool ...``);
- ``upsert`` (or any unknown field) in a load is ignored: a registered name answers ``already
  loaded``. Only the Miles fork honours ``upsert`` (opt in with ``--sglang-upsert``). Without it an
  in-place update is unload then load of the plain name, which the agent loads from a link it
  re-points first, so that SGLang's implicit re-load of a remembered name (any request naming it
  after the unload) reads the new version; ``already loaded`` right after our own unload is that
  re-load, and succeeds when ``/v1/models`` shows the name with the same path;
- ``/v1/models`` lists the registered adapters (``parent`` = the base, ``root`` = the path as
  given) and the base card (``parent: null``); ``/server_info`` (``/get_server_info`` before it)
  reports the LoRA limits the server was started with;
- ``POST /flush_cache`` empties the radix (prefix) cache; it takes no parameters. ``/detokenize``
  answers ``{"text"}`` where vLLM's answers ``{"prompt"}``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from lorafleet._http import error_message
from lorafleet.agent.backends.base import (
    AdapterMissing,
    EngineBackend,
    EngineProbe,
    EngineRejected,
    EngineReply,
    EngineUnavailable,
    PrefixCacheReset,
    json_dict,
    map_transport,
)
from lorafleet.protocol.agent import EngineCapabilities
from lorafleet.protocol.front import SGLangLoadLoRAAdapterRequest

__all__ = ["SGLangBackend"]

_ALREADY_LOADED = "already loaded"


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
        """The served name from ``/v1/models``, the limits from ``/server_info``; the agent's
        ``--max-lora-rank``/``--max-adapters`` override what the server reports."""
        base = str((await self.base_card())["id"])
        info = await self._server_info()
        if info.get("enable_lora") is False:
            raise EngineUnavailable(
                "SGLang runs without runtime LoRA: start it with --enable-lora and --max-lora-rank"
            )
        caps = EngineCapabilities(
            kind="sglang",
            max_lora_rank=self.max_lora_rank or _int(info.get("max_lora_rank")),
            # None on the server means no cap: it evicts nothing until the count exceeds one.
            max_adapters=self.max_adapters or _int(info.get("max_loaded_loras")),
            upsert=self.upsert,
            unload_frees_slot=True,
            max_loras_per_batch=_int(info.get("max_loras_per_batch")),
            lora_target_modules=_str_list(info.get("lora_target_modules")),
        )
        return EngineProbe(base_model=base, capabilities=caps)

    async def _server_info(self) -> dict:
        """``GET /server_info`` (``/get_server_info`` on older servers); ``{}`` without either."""
        for route in ("/server_info", "/get_server_info"):
            with map_transport(self.url):
                r = await self.http.get(route, timeout=10.0)
            if r.status_code == 200:
                return json_dict(r)
            if r.status_code != 404:
                raise EngineUnavailable(f"GET {route} answered {r.status_code}: {error_message(r)}")
        return {}

    async def reset_prefix_cache(self, reset_running_requests: bool) -> PrefixCacheReset:
        # /flush_cache takes no such choice (SGLang flushes only while no request runs, and
        # its refusal then is reported as it came: ``refused``).
        return await self._post_reset("/flush_cache", {})

    async def detokenize(self, body: dict[str, Any]) -> EngineReply:
        """SGLang's ``{"text"}`` answer also carries vLLM's ``{"prompt"}``, the name callers of
        a vLLM-shaped ``/detokenize`` read."""
        reply = await super().detokenize(body)
        if reply.status_code != 200:
            return reply
        try:
            out = json.loads(reply.content)
        except ValueError:
            return reply
        if not isinstance(out, dict) or "prompt" in out or "text" not in out:
            return reply
        out["prompt"] = out["text"]
        return EngineReply(200, json.dumps(out).encode(), "application/json")

    async def next_token_logprobs(
        self, base_model: str, engine_name: str | None, prompt_ids: list[int], k: int
    ) -> dict[int, float]:
        """SGLang's native ``/generate`` (its OpenAI route names tokens only by text):
        ``output_top_logprobs[0]`` lists ``(logprob, token_id, text)`` for the first token."""
        body: dict[str, Any] = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": k,
        }
        if engine_name is not None:
            body["lora_path"] = engine_name
        with map_transport(self.url):
            r = await self.http.post("/generate", json=body, timeout=60.0)
        if r.status_code != 200:
            raise EngineRejected(f"/generate answered {r.status_code}: {error_message(r)}")
        try:
            top = json_dict(r)["meta_info"]["output_top_logprobs"][0]
            return {int(item[1]): float(item[0]) for item in top}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineRejected(f"/generate answered no top logprobs: {r.text[:200]}") from exc

    async def list_adapters(self) -> dict[str, str]:
        return {
            str(c["id"]): str(c.get("root") or "") for c in await self.models() if c.get("parent")
        }

    async def _post(self, route: str, body: dict) -> dict:
        """The answer as ``{success, error_message, status}``; raises ``EngineUnavailable``."""
        with map_transport(self.url):
            r = await self.http.post(route, json=body)
        data = json_dict(r)
        if r.status_code == 404 and data.get("detail") == "Not Found":
            raise EngineUnavailable(f"the engine has no {route} route: is it SGLang?")
        if r.status_code == 200 and data.get("success", True):
            return data
        if r.status_code >= 500:
            raise EngineUnavailable(f"{route} answered {r.status_code}: {error_message(r)}")
        return {"success": False, "error_message": error_message(r), "status": r.status_code}

    async def load(self, name: str, path: str, *, replace: bool = False) -> None:
        upsert = replace and self.upsert
        # Only what is asked goes out: stock SGLang is never sent the fork's ``upsert``.
        body = SGLangLoadLoRAAdapterRequest(
            lora_name=name, lora_path=path, upsert=upsert
        ).model_dump(exclude_defaults=True)
        if replace and not upsert:
            # Not atomic (documented): SGLang refuses to load over a registered name.
            with contextlib.suppress(AdapterMissing):
                await self.unload(name)
        data = await self._post("/load_lora_adapter", body)
        if data.get("success", True):
            return
        msg = str(data.get("error_message") or "")
        if _ALREADY_LOADED in msg:
            if upsert:
                # A server that honoured upsert never says this: it ignored the field (stock
                # SGLang), and the name still serves the old weights.
                raise EngineRejected(
                    f"SGLang ignored upsert for {name!r} ({msg}): it is not the Miles fork; "
                    "start the agent without --sglang-upsert",
                    data.get("status"),
                )
            # The same name from the same path is what we asked for: an earlier load whose
            # answer was lost, or (after our own unload) a request that re-loaded the name from
            # its remembered path, which is ``path`` itself.
            with contextlib.suppress(EngineUnavailable):
                held = await self.list_adapters()
                if name in held and held[name] in ("", path):
                    return
        raise EngineRejected(f"SGLang refused to load {name!r}: {msg}", data.get("status"))

    async def unload(self, name: str) -> None:
        """Raises ``AdapterMissing`` when SGLang does not hold ``name`` (it may still remember
        its path: only removing the files there keeps a request from re-loading it)."""
        data = await self._post("/unload_lora_adapter", {"lora_name": name})
        if not data.get("success", True):
            msg = str(data.get("error_message") or "")
            if "does not exist" in msg or "not found" in msg.lower() or "not loaded" in msg:
                raise AdapterMissing(msg)
            raise EngineRejected(f"SGLang refused to unload {name!r}: {msg}", data.get("status"))


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_list(value: object) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple | set):
        return sorted(str(v) for v in value)
    return None
