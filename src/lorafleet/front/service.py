"""The front's logic, without HTTP: loads become publications, unloads retire, names map.

``Front`` owns one ``AsyncPublisher`` (shared-filesystem transfer, atomic, a retention window),
one HTTP client to the router and the agents, and one engine backend per replica (its kind's,
from ``lorafleet.engine_kinds``): every engine call goes through a backend, so no engine route or
kind is known here. ``lorafleet.front.app`` is the HTTP glue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import click
import httpx

from lorafleet._http import async_client
from lorafleet._service import check_token, identify_caller
from lorafleet._settings import setting
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.clients.router import AsyncRouterClient
from lorafleet.engine_kinds import EngineBackend, EngineReply, engine_kind
from lorafleet.errors import (
    AdapterNotFound,
    BundleError,
    Conflict,
    EngineRejected,
    EngineUnavailable,
    Forbidden,
    InvalidName,
    InvalidRequest,
    NotFound,
    PathNotAllowed,
    PublishError,
    ServiceError,
    TransportError,
)
from lorafleet.front.gate import GenerationGate
from lorafleet.front.names import DEFAULT_PATTERN, NameMap, TrainerName
from lorafleet.front.uploads import SkyRLUploads, UploadDirLimits
from lorafleet.protocol.agent import AgentInfo
from lorafleet.protocol.manifest import ALLOWED_FILES
from lorafleet.protocol.names import check_engine_name
from lorafleet.protocol.router import AliasEntry
from lorafleet.protocol.tenants import OPERATOR, Caller, Tenants, adapter_of
from lorafleet.publisher import AsyncPublisher, PublishResult
from lorafleet.publisher.cli import MinReplicas

__all__ = ["Front", "FrontConfig", "Network"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

HANDOVER_DIR = ".lorafleet-handover"
"""Under the first shared dir: where the Publisher hands files to the agents (then removes them)."""


@dataclass
class FrontConfig:
    agents: list[str]
    router: str
    shared_dirs: list[Path]
    fleet_token: str | None = None
    """The agents' and the router's control token (the Publisher's)."""
    api_key: str | None = None
    """The router's inference key: sent on forwarded generation."""
    trainer_token: str | None = None
    """Bearer token trainers send on control calls (default: ``fleet_token``)."""
    allow_unauthenticated_control: bool = False
    control_allow_from: list[Network] = field(
        default_factory=lambda: [
            ipaddress.ip_network("127.0.0.1/32"),
            ipaddress.ip_network("::1/128"),
        ]
    )
    name_pattern: str = setting(
        DEFAULT_PATTERN,
        flag="--name-pattern",
        help="Regex with groups name and version: trl-policy-v7 is trl-policy version 7. A name "
        "it does not match is the next version of that name.",
    )
    keep_versions: int = setting(
        2,
        flag="--keep-versions",
        type=click.IntRange(min=1),
        help="Versions of a name kept routable (the retention window).",
    )
    min_replicas: int | float | None = setting(
        None,
        flag="--min-replicas",
        type=MinReplicas(),
        help="Quorum for each publication: a count or a fraction like 0.75 (docs/quorum.md) "
        "[default: every replica].",
    )
    """A quorum for every publication a load makes (docs/quorum.md); None: every replica."""
    dtype: str | None = setting(
        None, flag="--dtype", help="dtype /server_info reports (default: the model's)."
    )
    """What ``/server_info`` reports; None reads the base model's config.json when local."""
    inference: str | None = setting(
        None,
        flag="--inference",
        help="Where forwarded generation goes: the data plane's address (a lorafleet dataplane "
        "copy, or the balancer in front of the copies; docs/router.md) [default: the router].",
    )
    """The data plane's URL; None: the router's own. Control calls always go to the router."""
    publish_timeout_s: float = 1800.0
    dialect: str = "vllm"
    """Which server's API the front speaks: a name in ``lorafleet.front.dialects.DIALECTS``."""
    upload_dir: Path | None = None
    """Where remote uploads (the SkyRL dialect's PUTs) are staged; None: remote upload is off."""
    upload_limits: UploadDirLimits = field(default_factory=UploadDirLimits)
    drain_timeout_s: float = 30.0
    """Retiring a name: how long its versions may take to finish their requests before they are
    released (a version still busy then stays loaded until the name is published again)."""
    tenants: Tenants | None = None
    """Tenants (``--tenants``): each one's token is a trainer token for its own names only; the
    trainer token stays the operator's, for every name (docs/tenants.md)."""


class Front:
    """One inference server's behaviour over a fleet, whatever its dialect. Every method raises
    ``ServiceError`` only."""

    def __init__(self, cfg: FrontConfig) -> None:
        if not cfg.shared_dirs:
            raise ValueError("the front needs at least one --shared-dir")
        if cfg.keep_versions < 1:
            raise ValueError("keep_versions is a positive count")
        self.cfg = cfg
        self.names = NameMap(cfg.name_pattern)
        self.shared_dirs = [Path(os.path.realpath(d)) for d in cfg.shared_dirs]
        self.trainer_token = cfg.trainer_token or cfg.fleet_token
        self.publisher = AsyncPublisher(
            cfg.agents,
            router=cfg.router,
            token=cfg.fleet_token,
            shared_dir=self.shared_dirs[0] / HANDOVER_DIR,
        )
        # No read timeout (generations are long); rollout workers keep hundreds in flight.
        self.http = async_client(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        )
        self.router = AsyncRouterClient(
            cfg.router, cfg.fleet_token, client=self.http, api_key=cfg.api_key
        )
        self.router_url = cfg.router.rstrip("/")
        self.inference_url = (cfg.inference or cfg.router).rstrip("/")
        self.paused = False
        # AReaL's pause: holds this front's generation and aborts what is in flight (front.gate).
        self.gate = GenerationGate()
        # What trainers loaded, under their own names: (name, version) -> (lora_name, lora_path).
        self.loaded: dict[tuple[str, int], tuple[str, str]] = {}
        # Versions a trainer unloaded that are still in the router's window: refused here.
        self.retired: set[tuple[str, int]] = set()
        self._aliases: dict[str, AliasEntry] = {}
        self._aliases_at = 0.0
        self._base: dict[str, Any] | None = None
        self._infos: list[AgentInfo] | None = None
        # One backend per engine, built on first use and closed with the front.
        self._engines: dict[tuple[str, str], EngineBackend] = {}
        self.uploads = (
            SkyRLUploads(cfg.upload_dir, cfg.upload_limits) if cfg.upload_dir is not None else None
        )
        self.tenants = cfg.tenants
        # One load at a time per tenant: its quota is judged and used in one step (here; loads
        # through another front may still pass the check together).
        self._tenant_locks: dict[str, asyncio.Lock] = {}

    async def aclose(self) -> None:
        if self.uploads is not None:
            await self.uploads.aclose()
        await self.publisher.aclose()
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await engine.aclose()
        await self.http.aclose()

    # -- auth -------------------------------------------------------------------------------------
    def check_control(self, authorization: str | None, client_host: str | None) -> Caller:
        """Admit a control call: a valid Bearer token, or (only when the operator allowed it) no
        token from an allow-listed address; returns who it is. The trainer token (and a
        tokenless call) is the operator's; with tenants, a tenant's token is that tenant's.
        Raises ``Unauthorized`` / ``Forbidden``."""
        if authorization or not self.cfg.allow_unauthenticated_control:
            if self.tenants is not None:
                return identify_caller(
                    authorization, self.trainer_token, self.tenants, open_without_operator=False
                )
            if self.trainer_token is None:
                raise Forbidden(
                    "this front accepts no control token (none configured); control calls are "
                    "accepted without one, from allow-listed addresses only"
                )
            check_token(authorization, self.trainer_token)
            return OPERATOR
        if not self._allowed(client_host):
            raise Forbidden(
                f"control calls without a token are accepted only from "
                f"{', '.join(map(str, self.cfg.control_allow_from))}; {client_host} is not "
                "allow-listed: send 'Authorization: Bearer <token>'"
            )
        return OPERATOR

    def check_reader(self, authorization: str | None, client_host: str | None) -> Caller:
        """Who a generation or a model listing comes from. Open, the operator's, as on the
        server a dialect impersonates; with tenants, admitted as a control call is
        (``check_control``), since the front forwards with the operator's inference key."""
        if self.tenants is None:
            return OPERATOR
        return self.check_control(authorization, client_host)

    def check_owner(self, caller: Caller, lora_name: str) -> None:
        """Refuse a control call naming an adapter ``caller`` does not own as the dialects
        refuse an unknown adapter (``AdapterNotFound``), whether it exists or not."""
        if caller.is_operator or self.names.is_base(lora_name):
            return
        if not caller.owns(self.names.parse(lora_name).name):
            raise AdapterNotFound(f"The lora adapter '{lora_name}' cannot be found.")

    async def _check_quota(self, caller: Caller, name: str, path: Path) -> None:
        """Refuse (``TenantQuotaExceeded``) a load that would take ``caller``'s tenant past its
        ``max_adapters`` or ``max_bytes``, from the router's table and the new bundle's size."""
        tenant = caller.tenant
        if tenant is None or (tenant.max_adapters is None and tenant.max_bytes is None):
            return
        tenant.check_quota(await self.aliases(0.0), name, _bundle_size(path))

    def _tenant_lock(self, caller: Caller) -> contextlib.AbstractAsyncContextManager[object]:
        if caller.tenant is None:
            return contextlib.nullcontext()
        return self._tenant_locks.setdefault(caller.tenant.id, asyncio.Lock())

    def _allowed(self, host: str | None) -> bool:
        if not host:
            return False
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.cfg.control_allow_from)

    # -- fleet facts ------------------------------------------------------------------------------
    async def agent_infos(self) -> list[AgentInfo]:
        if self._infos is None:
            clients = [
                AsyncAgentClient(u, self.cfg.fleet_token, client=self.http) for u in self.cfg.agents
            ]
            with _unavailable("agents"):
                self._infos = list(await asyncio.gather(*(c.info() for c in clients)))
        return self._infos

    def _engine(self, info: AgentInfo) -> EngineBackend:
        """The backend of ``info``'s engine (its kind's), built once."""
        key = (info.capabilities.kind, info.engine_url)
        engine = self._engines.get(key)
        if engine is None:
            engine = engine_kind(info.capabilities.kind).make_backend(info.engine_url)
            self._engines[key] = engine
        return engine

    async def base_model(self) -> dict[str, Any]:
        """The base model's card as one engine reports it (id, root, max_model_len)."""
        if self._base is None:
            infos = await self.agent_infos()
            card = dict(await self._engine(infos[0]).base_card(timeout=10.0))
            card.setdefault("root", infos[0].base_model)
            self._base = card
        return self._base

    async def aliases(self, max_age_s: float = 1.0) -> dict[str, AliasEntry]:
        """The router's alias table, at most ``max_age_s`` old."""
        if time.monotonic() - self._aliases_at > max_age_s:
            with _unavailable(self.router_url):
                table = await self.router.table()
            self._aliases, self._aliases_at = dict(table.aliases), time.monotonic()
        return self._aliases

    def _dtype(self, root: str | None) -> str:
        if self.cfg.dtype:
            return self.cfg.dtype
        with contextlib.suppress(OSError, ValueError, TypeError):
            config = json.loads((Path(str(root)) / "config.json").read_text())
            dtype = config.get("dtype") or config.get("torch_dtype")
            if dtype:
                return dtype if str(dtype).startswith("torch.") else f"torch.{dtype}"
        return "auto"

    async def models(self, caller: Caller = OPERATOR) -> dict:
        """``/v1/models`` as one vLLM server lists it: the base model, then every loaded adapter
        (``caller``'s own only, for a tenant)."""
        base = await self.base_model()
        now = int(time.time())
        data = [
            {
                "id": base["id"],
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": base.get("root"),
                "parent": None,
                "max_model_len": base.get("max_model_len"),
            }
        ]
        for name, entry in sorted((await self.aliases(0.0)).items()):
            if not caller.owns(name):
                continue
            for rv in entry.window():
                if (name, rv.version) in self.retired:
                    continue
                lora_name, path = self.loaded.get((name, rv.version), (name, rv.engine_name))
                if lora_name == name and rv.version != entry.version:
                    continue  # an unversioned name lists its newest version only
                data.append(
                    {
                        "id": lora_name,
                        "object": "model",
                        "created": now,
                        "owned_by": "vllm",
                        "root": path,
                        "parent": base["id"],
                        "max_model_len": None,
                        "lorafleet": {"adapter": name, "version": rv.version},
                    }
                )
        return {"object": "list", "data": data}

    async def server_info(self) -> dict:
        """``/server_info?config_format=json``: the fields trainers read, as one server has them.

        ``max_loras`` is the smallest engine's slot count, capped at ``keep_versions + 1``: TRL
        requires ``max_loras >= max_staleness + 2``, which then holds exactly when its staleness
        fits the front's retention window.
        """
        infos = await self.agent_infos()
        base = await self.base_model()
        ranks = [i.capabilities.max_lora_rank for i in infos if i.capabilities.max_lora_rank]
        slots = [i.capabilities.max_adapters for i in infos if i.capabilities.max_adapters]
        max_loras = min([*slots, self.cfg.keep_versions + 1])
        return {
            "vllm_config": {
                "model_config": {
                    "model": base.get("root"),
                    "served_model_name": base["id"],
                    "dtype": self._dtype(base.get("root")),
                    "max_model_len": base.get("max_model_len"),
                },
                "lora_config": {
                    "max_lora_rank": min(ranks) if ranks else 16,
                    "max_loras": max_loras,
                    "max_cpu_loras": max_loras,
                    "fully_sharded_loras": False,
                    "lora_dtype": "auto",
                },
                "parallel_config": {
                    "data_parallel_size": 1,
                    "tensor_parallel_size": 1,
                    "pipeline_parallel_size": 1,
                    "world_size": 1,
                },
                "lorafleet": {
                    "replicas": len(infos),
                    "router": self.router_url,
                    "keep_versions": self.cfg.keep_versions,
                },
            }
        }

    # -- control ----------------------------------------------------------------------------------
    def _check_path(self, lora_path: str) -> Path:
        """The adapter directory, resolved, if it lies under an allow-listed shared dir.
        Raises ``PathNotAllowed`` (403) outside them, ``InvalidRequest`` if it is no directory."""
        real = Path(os.path.realpath(lora_path))
        if not any(real == d or real.is_relative_to(d) for d in self.shared_dirs):
            raise PathNotAllowed(
                f"lora_path {lora_path!r} is not under a shared directory of this front "
                f"({', '.join(map(str, self.shared_dirs))})",
                param="lora_path",
            )
        if real.is_relative_to(self.shared_dirs[0] / HANDOVER_DIR):
            raise PathNotAllowed(f"lora_path {lora_path!r} is the front's own hand-over area")
        if not real.is_dir():
            raise InvalidRequest(f"lora_path {lora_path!r} is not a directory", param="lora_path")
        return real

    async def load(
        self, lora_name: str, lora_path: str, caller: Caller = OPERATOR
    ) -> PublishResult:
        """Publish the adapter at ``lora_path`` to every replica (atomic, verified).

        Raises ``AdapterNotFound`` (a name ``caller``'s tenant does not own), ``PathNotAllowed``,
        ``InvalidRequest`` (unreadable adapter), ``TenantQuotaExceeded``, ``AdapterInvalid``,
        ``VersionConflict`` (the version is not newer than the name's active one),
        ``PublishInProgress``, ``EngineRejected`` (a replica failed; nothing changed) or
        ``EngineUnavailable``.
        """
        self.check_owner(caller, lora_name)
        path = self._check_path(lora_path)
        return await self._publish(
            lora_name, path, "shared_filesystem", shown=lora_path, caller=caller
        )

    @staticmethod
    def upload_key(caller: Caller, upload_id: str) -> str:
        """Where ``caller``'s upload ``upload_id`` is staged: each tenant has uploads of its own,
        so that one never loads, feeds or discards another's (nor learns it exists)."""
        if caller.tenant is None:
            return upload_id
        ns = hashlib.sha256(caller.tenant.id.encode()).hexdigest()[:12]
        return f"t{ns}-{upload_id}"

    async def load_upload(
        self, lora_name: str, upload_id: str, caller: Caller = OPERATOR
    ) -> PublishResult:
        """Publish a remote upload (``lorafleet.front.uploads``) to every replica, then discard it.

        The bytes go out once, from here, and are relayed agent to agent (each copy verified).
        Raises ``Forbidden`` when remote upload is off, ``InvalidRequest`` "LoRA upload is
        incomplete." and everything ``load`` raises.
        """
        if self.uploads is None:
            raise Forbidden(
                "remote upload is off on this front: start it with --upload-dir, or load by a "
                "lora_path under its --shared-dir"
            )
        self.check_owner(caller, lora_name)
        transfer = "relay" if len(self.cfg.agents) > 1 else "remote_upload"
        key = self.upload_key(caller, upload_id)
        try:
            with self.uploads.claimed(key) as path:
                return await self._publish(
                    lora_name,
                    path,
                    transfer,
                    shown=f"upload {upload_id}",
                    record=False,
                    caller=caller,
                )
        finally:
            # SkyRL's server removes the staged files after a load; its client DELETEs anyway.
            self.uploads.discard(key)

    async def _publish(
        self,
        lora_name: str,
        path: Path,
        transfer: str,
        *,
        shown: str,
        record: bool = True,
        caller: Caller = OPERATOR,
    ) -> PublishResult:
        if self.names.is_base(lora_name):
            raise InvalidRequest(
                f"{lora_name!r} is version 0, the base model: it is served without loading",
                param="lora_name",
            )
        tn = self.names.parse(lora_name)
        async with self._tenant_lock(caller):
            await self._check_quota(caller, tn.name, path)
            return await self._published(lora_name, tn, path, transfer, shown, record)

    async def _published(
        self, lora_name: str, tn: TrainerName, path: Path, transfer: str, shown: str, record: bool
    ) -> PublishResult:
        try:
            result = await self.publisher.apublish(
                path,
                name=tn.name,
                version=tn.version,
                transfer=transfer,
                mode="atomic",
                keep_versions=self.cfg.keep_versions,
                min_replicas=self.cfg.min_replicas,
            )
        except ServiceError:
            raise
        except PublishError as exc:
            raise EngineRejected(
                f"publishing {lora_name!r} failed; nothing changed: {exc}"
            ) from exc
        except BundleError as exc:
            raise InvalidRequest(
                f"cannot read the adapter at {shown!r}: {exc}", param="lora_path"
            ) from exc
        except TransportError as exc:
            raise EngineUnavailable(f"publishing {lora_name!r}: {exc}") from exc
        except (ValueError, OSError) as exc:
            raise InvalidRequest(f"cannot publish {lora_name!r}: {exc}", param="lora_path") from exc
        self.loaded[(tn.name, result.version)] = (lora_name, str(path) if record else shown)
        self.retired = {k for k in self.retired if k[0] != tn.name or k[1] != result.version}
        self._aliases_at = 0.0
        return result

    async def unload(self, lora_name: str, caller: Caller = OPERATOR) -> str:
        """Retire what ``lora_name`` names. Returns what was done, in words.

        A version still in the router's window is refused here from now on and released by the
        agents when it leaves the window (at a later load); the newest version cannot be retired
        (``Conflict``: the name would have nothing to serve). Unknown names, and names
        ``caller``'s tenant does not own: ``AdapterNotFound``.
        """
        self.check_owner(caller, lora_name)
        tn = self.names.parse(lora_name)
        entry = (await self.aliases(0.0)).get(tn.name)
        if tn.version is None:
            if entry is None:
                raise AdapterNotFound(f"The lora adapter '{lora_name}' cannot be found.")
            raise Conflict(
                f"{lora_name!r} is served by its newest version; lorafleet keeps it until a newer "
                "one is loaded (unload a versioned name instead)",
                code="version_conflict",
                param="lora_name",
            )
        known = (tn.name, tn.version) in self.loaded
        window = [v.version for v in entry.window()] if entry else []
        if tn.version not in window:
            if known or (entry is not None and tn.version < entry.version):
                self.retired.discard((tn.name, tn.version))
                return f"{lora_name!r} already left the retention window; its replicas release it"
            raise AdapterNotFound(f"The lora adapter '{lora_name}' cannot be found.")
        assert entry is not None
        if tn.version == entry.version:
            raise Conflict(
                f"{lora_name!r} is the newest version of {tn.name!r}; load a newer one first",
                code="version_conflict",
                param="lora_name",
            )
        self.retired.add((tn.name, tn.version))
        return f"{lora_name!r} is no longer served; replicas release it when it leaves the window"

    async def retire_name(self, name: str, caller: Caller = OPERATOR) -> str:
        """Retire ``name`` whole (every version): the router refuses it at once (404, as vLLM
        refuses an unloaded adapter); each version is released on every replica once its
        requests finished (``drain_timeout_s``). Returns what was done, in words.

        Raises ``AdapterNotFound`` for a name that is not published (or not ``caller``'s
        tenant's), ``PublishInProgress`` while a publication of it runs,
        ``EngineUnavailable`` when the router does not answer.
        """
        tn = self.names.parse(name)
        if tn.version is not None and tn.name in await self.aliases(0.0) and caller.owns(tn.name):
            return await self.unload(name, caller)  # a versioned name retires that version only
        if not caller.owns(name):
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        entry = (await self.aliases(0.0)).get(name)
        if entry is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        holder = self.publisher.holder
        with _unavailable(self.router_url):
            # The publisher's own lease: no publication of the name (here or elsewhere) can flip
            # it while it goes away.
            await self.router.acquire_lease(name, holder, ttl_s=self.cfg.drain_timeout_s + 60)
            try:
                await self.router.delete_alias(name, lease_holder=holder)
            finally:
                with contextlib.suppress(ServiceError, TransportError, httpx.HTTPError):
                    await self.router.release_lease(name, holder)
        self._aliases_at = 0.0
        versions = [v.version for v in entry.window()]
        drained: list[int] = []
        busy: list[int] = []
        for v in versions:
            try:
                with _unavailable(self.router_url):
                    d = await self.router.drain(name, v, self.cfg.drain_timeout_s)
            except ServiceError:
                busy.append(v)
                continue
            (drained if d.drained else busy).append(v)
        problems = await self._release(name, set(drained))
        for key in [k for k in self.loaded if k[0] == name]:
            del self.loaded[key]
        self.retired = {k for k in self.retired if k[0] != name}
        words = f"{name!r} is retired: no longer served"
        if drained:
            words += f"; v{', v'.join(map(str, drained))} released"
        if busy:
            words += (
                f"; v{', v'.join(map(str, busy))} still had requests after "
                f"{self.cfg.drain_timeout_s:g} s and stay loaded until {name!r} is published again"
            )
        if problems:
            words += f"; {'; '.join(problems)}"
        return words

    async def _release(self, name: str, versions: set[int]) -> list[str]:
        """Unload ``versions`` of ``name`` on every agent that holds them; the problems."""
        problems: list[str] = []

        async def one(url: str) -> None:
            agent = AsyncAgentClient(url, self.cfg.fleet_token, client=self.http)
            try:
                held = [
                    r.version
                    for r in await agent.list_adapters()
                    if r.name == name and r.version in versions
                ]
                for v in held:
                    await agent.unload(name, v)
            except (ServiceError, TransportError, httpx.HTTPError) as exc:
                problems.append(f"{url}: {exc} (its agent releases it when it can)")

        await asyncio.gather(*(one(u) for u in self.cfg.agents))
        return problems

    # -- engines ----------------------------------------------------------------------------------
    async def reset_prefix_caches(self, reset_running_requests: bool) -> list[dict[str, Any]]:
        """Reset the prefix cache of every engine that has one; one outcome per replica
        (``{replica, kind, result[, detail]}``, the kind's ``PrefixCacheReset``).

        Never raises for one engine: a reset is an optimisation here, since every lorafleet
        version is a distinct adapter to the engine and a cached prefix of one version is never
        reused for another.
        """
        infos = await self.agent_infos()

        async def one(info: AgentInfo) -> dict[str, Any]:
            done = await self._engine(info).reset_prefix_cache(reset_running_requests)
            out: dict[str, Any] = {
                "replica": info.replica_id,
                "kind": info.capabilities.kind,
                "result": done.result,
            }
            if done.detail is not None:
                out["detail"] = done.detail
            return out

        return list(await asyncio.gather(*(one(i) for i in infos)))

    async def tokenize(self, body: dict[str, Any]) -> EngineReply:
        """``/tokenize`` with the base model's tokenizer, answered by the first engine that
        answers. Raises ``EngineUnavailable`` when none does."""
        return await self._first_engine("/tokenize", body, lambda e, b: e.tokenize(b))

    async def detokenize(self, body: dict[str, Any]) -> EngineReply:
        """``/detokenize`` (answering ``{"prompt"}`` on every kind), like ``tokenize``."""
        return await self._first_engine("/detokenize", body, lambda e, b: e.detokenize(b))

    async def _first_engine(
        self,
        what: str,
        body: dict[str, Any],
        call: Callable[[EngineBackend, dict[str, Any]], Awaitable[EngineReply]],
    ) -> EngineReply:
        """``call`` on each engine in turn until one answers, with ``model`` set to the base
        model's name: for LoRA-agnostic calls, which any replica answers the same."""
        infos = await self.agent_infos()
        base = await self.base_model()
        body = {**body, "model": base["id"]}
        last = ""
        for info in infos:
            try:
                return await call(self._engine(info), body)
            except EngineUnavailable as exc:
                last = str(exc)
        raise EngineUnavailable(f"no engine answered {what}: {last}")

    async def finish_session(self, session_id: str) -> dict[str, Any]:
        """End a sticky session at the router: its replica and its versions are forgotten."""
        with _unavailable(self.router_url):
            try:
                await self.router.finish_session(session_id)
            except ServiceError as exc:
                # Any refusal (a wrong key, a bad id) leaves the session open at the router: the
                # trainer is told the fleet is unavailable (503), as before the client had this.
                raise EngineUnavailable(
                    f"the router answered {exc.status} to finish_session"
                ) from exc
        return {"ok": True}

    # -- generation -------------------------------------------------------------------------------
    async def route_model(
        self, model: object, caller: Caller = OPERATOR, param: str = "model"
    ) -> str | None:
        """The router's ``model`` for a trainer's: ``trl-policy-v7`` -> ``trl-policy@v7`` when
        ``trl-policy`` is a published name; anything else unchanged. Raises ``AdapterNotFound``
        for a version a trainer unloaded; for a tenant, a model not its own (nor the base
        model) is answered here as the router answers a name that does not exist."""
        if not isinstance(model, str):
            return None
        if self.names.is_base(model):
            return str((await self.base_model())["id"])
        routed = await self._routed(model, caller)
        if not caller.is_operator:
            final = routed or model
            if not caller.owns(adapter_of(final)) and final != (await self.base_model())["id"]:
                _not_found(model, param)
        return routed

    async def _routed(self, model: str, caller: Caller) -> str | None:
        tn = self.names.parse(model)
        # For a tenant only its own names count as published: another's must not change what
        # its request becomes (nor, so, its answer).
        if tn.version is None or not caller.owns(tn.name):
            return None
        # A name loaded a moment ago through another front is found by the second, fresher look;
        # a base model whose name merely fits the pattern costs at most one look per 0.2 s.
        if tn.name not in await self.aliases() and tn.name not in await self.aliases(0.2):
            return None
        if (tn.name, tn.version) in self.retired:
            raise AdapterNotFound(f"The model `{model}` does not exist.", param="model")
        return NameMap.router_model(TrainerName(tn.name, tn.version))

    async def route_lora_path(self, lora_path: object, caller: Caller = OPERATOR) -> object:
        """SGLang's ``lora_path`` (one name, or one per prompt of a batch) for the router: each
        versioned name becomes its pin, version 0 becomes None (the base model)."""
        if isinstance(lora_path, list):
            return [await self.route_lora_path(p, caller) for p in lora_path]
        if self.names.is_base(lora_path):
            return None
        routed = await self.route_model(lora_path, caller, param="lora_path")
        return lora_path if routed is None else routed


def _not_found(model: str, param: str) -> NoReturn:
    """The router's answer to a ``model`` (or SGLang ``lora_path``) that names nothing."""
    try:
        check_engine_name(model, param=param)
    except InvalidName as exc:
        if param == "lora_path":
            exc.message = exc.message.replace("engine name", "lora_path")
        raise
    raise NotFound(f"The model `{model}` does not exist.", param=param)


def _bundle_size(path: Path) -> int:
    """The bytes a bundle of the directory ``path`` holds (its allow-listed files)."""
    total = 0
    for name in ALLOWED_FILES:
        with contextlib.suppress(OSError):
            if (path / name).is_file():
                total += (path / name).stat().st_size
    return total


@contextlib.contextmanager
def _unavailable(what: str):
    """Transport failures toward the fleet become 503 ``engine_unavailable``."""
    try:
        yield
    except TransportError as exc:
        raise EngineUnavailable(f"{what} unreachable: {exc}") from exc
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"{what} unreachable: {exc}") from exc


def parse_networks(specs: Sequence[str]) -> list[Network]:
    """``["127.0.0.1", "10.0.0.0/8"]`` -> networks. Raises ``ValueError``."""
    return [ipaddress.ip_network(s.strip(), strict=False) for s in specs if s.strip()]
