"""``RayFleet``: a lorafleet fleet on a Ray cluster, deployed or attached, found by namespace.

What runs where:

- per replica, one placement group (a ``STRICT_PACK`` bundle) holds the engine's actor and its
  agent's actor, so they share a node; replicas are aimed at distinct nodes (round robin over
  the cluster's alive nodes, a soft target: a full node does not block the deployment);
- each actor is a ``ServerActor``: it launches its server (``lorafleet engine|agent|router`` or a
  real vLLM/SGLang server) as a subprocess with the ``lorafleet.launch`` specs, listening on the
  node's address;
- one router actor (the control plane) and one small ``FleetRecord`` actor that remembers the
  fleet (URLs, tokens, actor names), so ``attach(namespace)`` needs no URL list; both prefer the
  head node (soft);
- with ``copies_per_node``, data-plane copies on every alive node (``lorafleet dataplane``, one
  actor per node, pinned there): clients reach any of them, through a balancer or a DNS name
  over ``RayFleet.dataplane_urls``; each keeps serving when the router actor is down.

Every actor is named in the fleet's namespace and restarted by Ray when its process dies
(``max_restarts``); a restarted actor takes its server's port again. When a node dies, Ray
re-places its replicas' placement groups on other nodes; the re-placed agent tells the record
and the router its new URL (see ``lorafleet.ray._actors``), and ``RayFleet.publisher()`` reads
the record again, so the next publication reaches it.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from lorafleet.agent.spec import AgentSpec
from lorafleet.dataplane.spec import DataPlaneSpec
from lorafleet.engine_kinds import ENGINE_KINDS, engine_kind
from lorafleet.fleetfile import FleetInfo, ReplicaInfo, write_fleet_file
from lorafleet.publisher import Publisher
from lorafleet.ray._actors import Seat, ServerActor
from lorafleet.ray._record import RECORD, FleetRecord, find_record
from lorafleet.ray.transfer import ObjectStoreCarrier
from lorafleet.router.spec import RouterSpec

__all__ = ["EngineOnRay", "RayFleet", "attach", "attach_engines", "deploy"]

DEFAULT_NAMESPACE = "lorafleet"
DEFAULT_WORKDIR = "/tmp/lorafleet-ray"
_ROUTER = "lorafleet-router"
_NAME_RELEASE_S = 10.0  # how long shutdown waits for Ray to free the actors' names

_ServerActor = ray.remote(ServerActor)
_FleetRecord = ray.remote(FleetRecord)


@dataclass(frozen=True)
class EngineOnRay:
    """An engine a trainer already runs on the cluster: its URL (reachable from its node) and the
    Ray node id it runs on (``ray.get_runtime_context().get_node_id()`` in its actor)."""

    url: str
    node_id: str
    engine: str = "vllm"
    """Backend kind for the agent: vllm, sglang or reference."""


@dataclass
class RayReplica:
    index: int
    engine: str
    engine_url: str
    agent_url: str
    node_id: str
    agent_actor: str
    engine_actor: str | None = None
    """None: an engine lorafleet attached to, not one it runs."""


@dataclass
class RayFleet:
    """A fleet on Ray. Get one from ``deploy``, ``attach_engines`` or ``attach(namespace)``."""

    namespace: str
    router_url: str
    token: str
    api_key: str | None
    served_model_name: str
    model: str | None
    replicas: list[RayReplica]
    placement_groups: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    dataplane: dict[str, str] = field(default_factory=dict)
    """Data-plane copies: actor name -> URL (one per node; empty: the router serves)."""

    # -- finding it again ------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "router_url": self.router_url,
            "token": self.token,
            "api_key": self.api_key,
            "served_model_name": self.served_model_name,
            "model": self.model,
            "replicas": [vars(r).copy() for r in self.replicas],
            "placement_groups": list(self.placement_groups),
            "started_at": self.started_at,
            "dataplane": dict(self.dataplane),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RayFleet:
        fields = dict(record)
        fields["replicas"] = [RayReplica(**r) for r in record["replicas"]]
        return cls(**fields)

    # -- using it --------------------------------------------------------------------------
    @property
    def agent_urls(self) -> list[str]:
        return [r.agent_url for r in self.replicas]

    @property
    def dataplane_urls(self) -> list[str]:
        """Every data-plane copy's URL (one per node): put a balancer or DNS name over them."""
        return sorted(self.dataplane.values())

    @property
    def dataplane_url(self) -> str | None:
        """One copy's URL, for ``fleet.json`` (None: the router serves the data plane)."""
        urls = self.dataplane_urls
        return urls[0] if urls else None

    @property
    def engine_urls(self) -> list[str]:
        return [r.engine_url for r in self.replicas]

    def refresh(self) -> RayFleet:
        """Read the fleet's record again: replicas re-placed after a node loss have new URLs.
        Keeps what it knew when the record actor does not answer."""
        record = find_record(self.namespace)
        if record is not None:
            try:
                now = RayFleet.from_record(ray.get(record.get.remote(), timeout=30))
            except (ray.exceptions.RayError, TimeoutError):
                return self
            self.router_url, self.replicas = now.router_url, now.replicas
            self.dataplane = now.dataplane
        return self

    def publisher(self, **kwargs: Any) -> Publisher:
        """A ``Publisher`` over this fleet's agents and its router (``kwargs`` go to it), with
        Ray's ``object_store`` transfer beside its own (``transfer="object_store"``). Reads the
        record first (``refresh``)."""
        self.refresh()
        carrier = ObjectStoreCarrier(
            {r.agent_url: r.agent_actor for r in self.replicas}, self.namespace
        )
        carriers = {"object_store": carrier, **kwargs.pop("carriers", {})}
        return Publisher(
            self.agent_urls, router=self.router_url, token=self.token, carriers=carriers, **kwargs
        )

    def actor(self, name: str) -> Any:
        return ray.get_actor(name, namespace=self.namespace)

    def agent_actor(self, index: int) -> Any:
        return self.actor(self.replicas[index].agent_actor)

    def engine_actor(self, index: int) -> Any:
        name = self.replicas[index].engine_actor
        if name is None:
            raise ValueError(f"replica {index}'s engine is not run by lorafleet (attached)")
        return self.actor(name)

    def servers(self, timeout: float = 10.0) -> dict[str, dict[str, Any] | None]:
        """Each actor's ``info()`` by actor name (None: the actor does not answer)."""
        names = [_ROUTER, *self.dataplane]
        for r in self.replicas:
            names += [n for n in (r.agent_actor, r.engine_actor) if n is not None]
        out: dict[str, dict[str, Any] | None] = {}
        for name in names:
            try:
                out[name] = ray.get(self.actor(name).info.remote(), timeout=timeout)
            except Exception:  # dead, restarting or gone: reported as None
                out[name] = None
        return out

    def info(self, data_dir: str | None = None, pid: int | None = None) -> FleetInfo:
        """The fleet as ``fleet.json`` records it (``lorafleet status`` reads that)."""
        servers = self.servers()

        def pid_of(name: str | None) -> int | None:
            got = servers.get(name) if name else None
            return got["pid"] if got else None

        replicas = [
            ReplicaInfo(
                engine=r.engine,
                engine_url=r.engine_url,
                agent_url=r.agent_url,
                agent_pid=pid_of(r.agent_actor),
                engine_pid=pid_of(r.engine_actor),
            )
            for r in self.replicas
        ]
        return FleetInfo.of(
            self,
            replicas,
            data_dir=data_dir or f"ray://{self.namespace}",
            pid=pid,
            router_pid=pid_of(_ROUTER),
        )

    def status(self):
        """The router's and every agent's view (``lorafleet.fleet.status.FleetStatus``), at
        the URLs the record holds now (``refresh``)."""
        from lorafleet.fleet.status import collect_status

        return collect_status(self.refresh().info())

    def write_fleet_file(self, data_dir: str | Path, pid: int | None = None) -> Path:
        """Write ``fleet.json`` so ``lorafleet status`` and ``publish --fleet`` find this fleet
        (``pid``: the process that owns it, e.g. ``lorafleet up --ray``)."""
        d = Path(data_dir).absolute()
        return write_fleet_file(self.info(str(d), pid), d)

    def shutdown(self) -> None:
        """Stop the router, the agents and the engines lorafleet runs (never attached engines),
        remove the placement groups and forget the fleet. Idempotent."""
        names = [*self.dataplane, _ROUTER]
        names += [r.agent_actor for r in self.replicas]
        names += [r.engine_actor for r in self.replicas if r.engine_actor]
        _kill_actors(names, self.namespace)
        record = find_record(self.namespace)
        if record is not None:  # its file holds the tokens
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                ray.get(record.forget.remote(), timeout=30)
        _kill_actors([RECORD], self.namespace, stop=False)
        for pg_name in self.placement_groups:
            with contextlib.suppress(ValueError):
                remove_placement_group(ray.util.get_placement_group(pg_name))


def attach(namespace: str = DEFAULT_NAMESPACE) -> RayFleet:
    """The fleet deployed (or attached) in ``namespace``, found through its named actors.

    Raises ``LookupError`` when no fleet runs there.
    """
    record = find_record(namespace)
    missing = LookupError(f"no lorafleet fleet in Ray namespace {namespace!r}")
    if record is None:
        raise missing
    try:
        return RayFleet.from_record(ray.get(record.get.remote()))
    except ray.exceptions.ActorDiedError as exc:  # shut down between the lookup and the call
        raise missing from exc


def deploy(
    n_replicas: int = 2,
    *,
    engine: str = "reference",
    model: str | Path | None = None,
    engine_args: Mapping[str, Any] | None = None,
    agent_args: Mapping[str, Any] | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    engine_cpus: float = 1.0,
    engine_gpus: float = 0.0,
    engine_resources: Mapping[str, float] | None = None,
    agent_cpus: float = 0.25,
    router_cpus: float = 0.25,
    token: str | None = None,
    api_key: str | None = None,
    workdir: str = DEFAULT_WORKDIR,
    bind: str = "node",
    spread: bool = True,
    max_restarts: int = 3,
    detached: bool = True,
    router_args: Mapping[str, Any] | None = None,
    pg_timeout: float = 120.0,
    copies_per_node: int = 0,
    copy_cpus: float = 0.25,
) -> RayFleet:
    """Deploy ``n_replicas`` engines, an agent beside each and a router onto the Ray cluster this
    process is connected to (``ray.init`` first). See the module docstring for the placement.

    ``engine``: reference, vllm or sglang; ``engine_args`` go to its spec
    (``lorafleet.launch.ReferenceEngineSpec``, ``VLLMSpec``, ``SGLangSpec``), ``agent_args`` to
    every ``AgentSpec`` (e.g. ``max_lora_rank``). ``model``: a path
    valid on every node (required for vllm and sglang; the reference engine defaults to the tiny
    model, generated on each node). ``token``/``api_key``: the control token of agents and
    router and the router's inference key; None generates them (``api_key=""``: open data plane).
    ``workdir``: on every node, logs, agent stores and router state under
    ``workdir/namespace``. ``bind="node"``: servers listen on their node's Ray address.
    ``copies_per_node``: data-plane copies on every alive node (workers of one
    ``lorafleet dataplane`` per node, ``copy_cpus`` each), kept current by the router.

    Raises ``ValueError`` if ``namespace`` already holds a fleet; anything started is torn down
    when a later step fails.
    """
    if engine not in ENGINE_KINDS:
        raise ValueError(f"engine must be one of {sorted(ENGINE_KINDS)}, not {engine!r}")
    if model is None and not engine_kind(engine).embedded:
        raise ValueError(f"a {engine} engine needs model= (a path valid on every node)")
    _refuse_existing(namespace)
    token = token or secrets.token_urlsafe(24)
    api_key = secrets.token_urlsafe(24) if api_key is None else (api_key or None)
    root = f"{workdir}/{namespace}"
    served = str((engine_args or {}).get("served_model_name", "tiny"))
    fleet = RayFleet(
        namespace=namespace,
        router_url="",
        token=token,
        api_key=api_key,
        served_model_name=served,
        model=str(model) if model is not None else None,
        replicas=[],
    )
    try:
        pgs = _placement_groups(
            n_replicas,
            namespace,
            bundle={
                "CPU": engine_cpus + agent_cpus,
                **({"GPU": engine_gpus} if engine_gpus else {}),
                **dict(engine_resources or {}),
            },
            spread=spread,
        )
        fleet.placement_groups = [pg_name for pg_name, _ in pgs]
        ready = [pg.ready() for _, pg in pgs]
        ray.get(ready, timeout=pg_timeout)
        # Engines first (in parallel), then their agents, then the router.
        spec_cls = engine_kind(engine).spec_class()
        engine_actors = []
        for i, (_, pg) in enumerate(pgs):
            args = dict(engine_args or {})
            args.setdefault("name", f"engine-{i}")
            spec = spec_cls(model=Path(model) if model is not None else Path(), **args)
            name = f"lorafleet-engine-{i}"
            actor = _ServerActor.options(
                name=name,
                namespace=namespace,
                lifetime="detached" if detached else None,
                num_cpus=engine_cpus,
                num_gpus=engine_gpus,
                resources=dict(engine_resources or {}),
                max_restarts=max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
            ).remote(spec, f"{root}/replica-{i}", bind, tiny_model=model is None)
            engine_actors.append((name, actor))
        engines = ray.get([a.info.remote() for _, a in engine_actors])
        agent_actors = [
            _start_agent_actor(
                i, engine, eng["url"], root, token, namespace,
                strategy=PlacementGroupSchedulingStrategy(pg, 0),
                detached=detached, num_cpus=agent_cpus, max_restarts=max_restarts, bind=bind,
                agent_args=agent_args, engine_actor=engine_actors[i][0],
            )
            for i, ((_, pg), eng) in enumerate(zip(pgs, engines, strict=True))
        ]  # fmt: skip
        placed = [EngineOnRay(e["url"], node_id=e["node_id"], engine=engine) for e in engines]
        return _finish(
            fleet, placed, agent_actors, [name for name, _ in engine_actors],
            root=root, bind=bind, router_cpus=router_cpus, max_restarts=max_restarts,
            detached=detached, router_args=router_args, copies_per_node=copies_per_node,
            copy_cpus=copy_cpus,
        )  # fmt: skip
    except BaseException:
        fleet.shutdown()
        raise


def attach_engines(
    engines: Sequence[EngineOnRay],
    *,
    namespace: str = DEFAULT_NAMESPACE,
    served_model_name: str = "tiny",
    model: str | None = None,
    agent_args: Mapping[str, Any] | None = None,
    agent_cpus: float = 0.25,
    router_cpus: float = 0.25,
    token: str | None = None,
    api_key: str | None = None,
    workdir: str = DEFAULT_WORKDIR,
    bind: str = "node",
    max_restarts: int = 3,
    detached: bool = True,
    router_args: Mapping[str, Any] | None = None,
    copies_per_node: int = 0,
    copy_cpus: float = 0.25,
) -> RayFleet:
    """Put an agent beside each engine a trainer already runs (on the engine's node, by node
    affinity) and a router over them; the fleet is found later with ``attach(namespace)``.

    The engines stay the trainer's: ``shutdown()`` stops only the agents and the router.
    """
    if not engines:
        raise ValueError("attach_engines needs at least one engine")
    _refuse_existing(namespace)
    token = token or secrets.token_urlsafe(24)
    api_key = secrets.token_urlsafe(24) if api_key is None else (api_key or None)
    root = f"{workdir}/{namespace}"
    fleet = RayFleet(
        namespace=namespace,
        router_url="",
        token=token,
        api_key=api_key,
        served_model_name=served_model_name,
        model=model,
        replicas=[],
    )
    try:
        agent_actors = [
            _start_agent_actor(
                i, eng.engine, eng.url.rstrip("/"), root, token, namespace,
                strategy=NodeAffinitySchedulingStrategy(eng.node_id, soft=False),
                detached=detached, num_cpus=agent_cpus, max_restarts=max_restarts, bind=bind,
                agent_args=agent_args,
            )
            for i, eng in enumerate(engines)
        ]  # fmt: skip
        # A replica's node is its engine's; its agent is pinned there (hard affinity).
        placed = [
            EngineOnRay(e.url.rstrip("/"), node_id=e.node_id, engine=e.engine) for e in engines
        ]
        return _finish(
            fleet, placed, agent_actors, [None] * len(placed),
            root=root, bind=bind, router_cpus=router_cpus, max_restarts=max_restarts,
            detached=detached, router_args=router_args, copies_per_node=copies_per_node,
            copy_cpus=copy_cpus,
        )  # fmt: skip
    except BaseException:
        fleet.shutdown()
        raise


# -- internals ---------------------------------------------------------------------------------


def _finish(
    fleet: RayFleet,
    engines: Sequence[EngineOnRay],
    agent_actors: Sequence[tuple[str, Any]],
    engine_actors: Sequence[str | None],
    *,
    root: str,
    bind: str,
    router_cpus: float,
    max_restarts: int,
    detached: bool,
    router_args: Mapping[str, Any] | None,
    copies_per_node: int = 0,
    copy_cpus: float = 0.25,
) -> RayFleet:
    """The end of ``deploy`` and ``attach_engines``: wait for the agents, record one replica per
    engine (``engine_actors``: the engine's actor, None for an engine lorafleet only attached
    to), then start the router and the record. The caller tears the fleet down on failure."""
    agents = ray.get([a.info.remote() for _, a in agent_actors])
    fleet.replicas = [
        RayReplica(
            index=i,
            engine=eng.engine,
            engine_url=eng.url,
            agent_url=agt["url"],
            node_id=eng.node_id,
            agent_actor=agent_name,
            engine_actor=engine_actor,
        )
        for i, (eng, agt, (agent_name, _), engine_actor) in enumerate(
            zip(engines, agents, agent_actors, engine_actors, strict=True)
        )
    ]
    if copies_per_node:
        # The copies sync from the router before it is recorded, so they go in the record too.
        _start_router(fleet, root, bind, router_cpus, max_restarts, detached,
                      dict(router_args or {}), record=False)  # fmt: skip
        _start_copies(fleet, root, bind, copies_per_node, copy_cpus, max_restarts, detached)
        _start_record(fleet, root, detached)
    else:
        _start_router(
            fleet, root, bind, router_cpus, max_restarts, detached, dict(router_args or {})
        )
    return fleet


def _start_agent_actor(
    i: int,
    engine: str,
    engine_url: str,
    root: str,
    token: str,
    namespace: str,
    *,
    strategy: Any,
    detached: bool,
    num_cpus: float,
    max_restarts: int,
    bind: str,
    agent_args: Mapping[str, Any] | None = None,
    engine_actor: str | None = None,
) -> tuple[str, Any]:
    """Replica ``i``'s agent as a named actor placed by ``strategy`` (beside its engine).
    ``engine_actor``: the engine's actor, asked for its URL again after a re-placement."""
    spec = AgentSpec(
        engine=engine,
        engine_url=engine_url,
        data_dir=Path("agent"),  # relative: on the agent's node (ServerActor)
        token=token,
        replica_id=f"replica-{i}",
        name=f"agent-{i}",
        **dict(agent_args or {}),
    )
    name = f"lorafleet-agent-{i}"
    actor = _ServerActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached" if detached else None,
        num_cpus=num_cpus,
        max_restarts=max_restarts,
        scheduling_strategy=strategy,
    ).remote(spec, f"{root}/replica-{i}", bind, seat=Seat(namespace, "agent", i, engine_actor))
    return name, actor


def _refuse_existing(namespace: str) -> None:
    if find_record(namespace) is not None:
        raise ValueError(
            f"Ray namespace {namespace!r} already holds a lorafleet fleet: attach() to it or "
            "shut it down first"
        )


def _placement_groups(
    n: int, namespace: str, bundle: dict[str, float], spread: bool
) -> list[tuple[str, PlacementGroup]]:
    """One STRICT_PACK placement group per replica, aimed at distinct nodes (soft)."""
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    out = []
    for i in range(n):
        target = nodes[i % len(nodes)] if spread and nodes else None
        name = f"lorafleet-{namespace}-replica-{i}"
        pg = placement_group(
            [bundle],
            strategy="STRICT_PACK",
            name=name,
            lifetime="detached",
            _soft_target_node_id=target,
        )
        out.append((name, pg))
    return out


def _start_router(
    fleet: RayFleet,
    root: str,
    bind: str,
    cpus: float,
    max_restarts: int,
    detached: bool,
    router_args: dict[str, Any],
    *,
    record: bool = True,
) -> None:
    spec = RouterSpec(
        agents=tuple(fleet.agent_urls),
        token=fleet.token,
        api_key=fleet.api_key,
        state_dir=Path("state"),  # relative: on the router's node (ServerActor)
        name="router",
        **router_args,
    )
    router = _ServerActor.options(
        name=_ROUTER,
        namespace=fleet.namespace,
        lifetime="detached" if detached else None,
        num_cpus=cpus,
        max_restarts=max_restarts,
        scheduling_strategy=_head_node(),
    ).remote(spec, f"{root}/router", bind, seat=Seat(fleet.namespace, "router"))
    fleet.router_url = ray.get(router.info.remote())["url"]
    if record:
        _start_record(fleet, root, detached)


def _start_copies(
    fleet: RayFleet,
    root: str,
    bind: str,
    workers: int,
    cpus: float,
    max_restarts: int,
    detached: bool,
) -> None:
    """``lorafleet dataplane --workers N`` on every alive node, pinned there (hard affinity: a
    copy belongs to its node; Ray restarts it there, on the same port)."""
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    actors = []
    for node in nodes:
        spec = DataPlaneSpec(
            control_url=fleet.router_url,
            token=fleet.token,
            api_key=fleet.api_key,
            workers=workers,
            name="dataplane",
        )
        name = f"lorafleet-dataplane-{node[:12]}"
        actor = _ServerActor.options(
            name=name,
            namespace=fleet.namespace,
            lifetime="detached" if detached else None,
            num_cpus=cpus,
            max_restarts=max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(spec, f"{root}/dataplane", bind)
        actors.append((name, actor))
    infos = ray.get([a.info.remote() for _, a in actors])
    fleet.dataplane = {name: info["url"] for (name, _), info in zip(actors, infos, strict=True)}


def _start_record(fleet: RayFleet, root: str, detached: bool) -> None:
    record = _FleetRecord.options(
        name=RECORD,
        namespace=fleet.namespace,
        lifetime="detached" if detached else None,
        num_cpus=0,
        max_restarts=-1,
        scheduling_strategy=_head_node(),
    ).remote(fleet.to_record(), f"{root}/record.json")
    ray.get(record.get.remote())  # written to its file before anyone may need it


def _head_node() -> Any:
    """Prefer the head node (soft): the router's state and the record's file live on their
    node's disk, and the head node is the one a cluster cannot lose and go on."""
    head = [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})
    ]
    return NodeAffinitySchedulingStrategy(head[0], soft=True) if head else "DEFAULT"


def _kill_actors(names: Sequence[str], namespace: str, *, stop: bool = True) -> None:
    """Stop each server politely (if its actor answers), then kill the actor for good."""
    handles = []
    for name in names:
        try:
            handles.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            continue
    if stop:
        stops = [h.stop.remote() for h in handles]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=30)
    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h, no_restart=True)
    # ray.kill returns before the GCS frees the name; until it does, get_actor still hands out
    # the dead actor, and a deploy or attach in the same namespace would meet it.
    deadline = time.monotonic() + _NAME_RELEASE_S
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            time.sleep(0.05)
