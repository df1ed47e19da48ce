"""Chaos: atomic publications under bursty routed traffic while processes are SIGKILLed.

A seeded loop publishes small adapters (new weights every time) through one ``Publisher`` to a
fleet of 2 replicas (reference engine + agent each) behind one router with a state directory.
A background thread sends bursts of concurrent completions for the name with idle gaps between
them (RL rollouts). A chaos thread SIGKILLs one process at a time at random: an engine, an agent
or the router; it stays down for a random while and is restarted on the same port (a supervisor's
job). The seed is printed; ``LORAFLEET_CHAOS_SEED=<n>`` replays a run's choices (the timing of a
busy machine does not replay).

Invariants, checked on every response and after every publication:

- **No failed request while a replica holding the active version is alive.** A replica is
  *alive* over a request's lifetime [sent, answered] when neither its engine nor its agent was
  down at any instant of it: a process is *down* from just before the test SIGKILLs it until
  it is restarted and its agent answers ``/health`` 200 again (ready: the engine holds every
  desired adapter again). Both replicas hold the active version (an atomic publication flips
  only once every replica loaded it). Faults are injected one at a time, so one replica is
  always alive; a request is excused only while the *router* was down during its lifetime
  (nothing can answer it then): such failures are counted and reported, not asserted on.
- **Every response is produced by a version that was active while it was in flight.** The
  router's flip log gives each cutover's instant (``ts``, taken in the same synchronous block
  that swaps the table). A request reaches the router at some instant of [sent, answered], so
  its version must be one that was active at some instant of that interval. The header, the
  body's ``lorafleet.version`` and the engine's own model name (``policy@vN``) must agree.
- **No staged bytes once ``publish()`` returns or raises.** On every agent that stayed up for
  the whole publication: nothing under ``staging/``, no ``staged`` record, and no record of the
  published version unless it is the router's active one. An agent killed during the
  publication cannot be cleaned by it: its restart clears ``staging/``, and what it kept is
  superseded by a later publication (both checked at the end). An engine killed during it
  leaves the version ``retiring`` or loaded-unknown until it answers again; the agent then
  retires it itself (checked once it is ready).
- **The loop never needs a person.** After the chaos, with every process back, one more
  publication succeeds and serves, and each agent holds exactly that version and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from lorafleet._http import async_client
from lorafleet.errors import LorafleetError
from lorafleet.publisher import Publisher
from lorafleet.publisher.result import Timeouts
from lorafleet.testing import make_peft_model, wait_until

pytestmark = pytest.mark.timeout(400)

NAME = "policy"
CHAOS_S = float(os.environ.get("LORAFLEET_CHAOS_SECONDS", "35"))
"""How long faults are injected (publications and traffic run throughout)."""
MAX_FAULTS = 8


# -- the record of what the test did -------------------------------------------------------------


@dataclass
class Outage:
    what: str
    down: float
    up: float = float("inf")


@dataclass
class Record:
    outages: list[Outage] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, what: str) -> Outage:
        o = Outage(what, time.time())
        with self.lock:
            self.outages.append(o)
        return o

    def overlaps(self, what: str, start: float, end: float) -> bool:
        with self.lock:
            return any(o.what == what and o.down <= end and o.up >= start for o in self.outages)

    def replica_alive(self, i: int, start: float, end: float) -> bool:
        return not (
            self.overlaps(f"engine{i}", start, end) or self.overlaps(f"agent{i}", start, end)
        )


@dataclass
class Answer:
    sent: float
    done: float
    status: int
    header_version: str | None = None
    tag: dict | None = None
    error: str | None = None


# -- the processes under test ---------------------------------------------------------------------


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chaos(fleet, launcher, rec: Record, rng: random.Random, stop: threading.Event) -> Counter:
    """Kill one process at a time, keep it down a while, restart it on its port, wait until
    its replica is ready again. Returns how many of each were killed."""
    killed: Counter = Counter()
    # Every kind at least once (an engine restart costs ~10 s here: torch), then at random.
    kinds = ["engine", "agent", "agent", "router", "router"]
    rng.shuffle(kinds)
    kinds += [rng.choice(["engine", "agent", "router"]) for _ in range(MAX_FAULTS - len(kinds))]
    deadline = time.time() + CHAOS_S
    for kind in kinds:
        if stop.wait(rng.uniform(0.5, 2.5)) or time.time() > deadline:
            break
        what = kind if kind == "router" else f"{kind}{rng.randrange(2)}"
        servers = {"engine": fleet.engines, "agent": fleet.agents}
        server = fleet.router if kind == "router" else servers[kind][int(what[-1])]
        outage = rec.begin(what)
        server.proc.kill()  # SIGKILL of the whole process group
        killed[kind] += 1
        time.sleep(rng.uniform(0.2, 2.5))
        launcher.restart(server)  # same spec, same port; waits for its /health
        if what != "router":
            agent = fleet.agents[int(what[-1])]
            wait_until(lambda a=agent: _ready(a.url), timeout=120, message=f"{what}'s agent ready")
        outage.up = time.time()
    return killed


def traffic(router_url: str, rng: random.Random, stop: threading.Event, out: list[Answer]):
    """Bursts of 2-10 concurrent completions of ``NAME``, 0.1-1.5 s of silence between them."""

    async def one(client: httpx.AsyncClient) -> None:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        sent = time.time()
        try:
            r = await client.post(router_url + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            out.append(Answer(sent, time.time(), 0, error=f"{type(exc).__name__}: {exc}"))
            return
        a = Answer(sent, time.time(), r.status_code, r.headers.get("x-lorafleet-adapter-version"))
        with contextlib.suppress(ValueError):
            a.tag = r.json().get("lorafleet")
        if r.status_code != 200:
            a.error = r.text[:300]
        out.append(a)

    async def run() -> None:
        # lorafleet's own client: a connection the router closed under it (killed, or idle) is
        # sent again once on a fresh one, as any keep-alive client must.
        async with async_client(timeout=60) as client:
            while not stop.is_set():
                n = rng.randint(2, 10)
                await asyncio.gather(*(one(client) for _ in range(n)))
                await asyncio.sleep(rng.uniform(0.1, 1.5))

    asyncio.run(run())


# -- checks ---------------------------------------------------------------------------------------


def _ctl(fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.token}"}


def router_table(fleet) -> dict:
    """The router's table, waiting for the router to be back if it is down."""
    last: Exception | None = None
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            r = httpx.get(fleet.router.url + "/v1/control/aliases", headers=_ctl(fleet), timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"the router's table stayed unreadable: {last}")


def agent_records(fleet, i: int) -> list[dict] | None:
    try:
        return fleet.adapters(i)
    except httpx.HTTPError:
        return None  # down right now


def staging_files(agent) -> list[str]:
    root = agent.spec.data_dir / "staging"
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs] + [
        d for d, subs, fs in os.walk(root) if d != str(root) and not subs and not fs
    ]


def allowed_versions(flips: list[tuple[float, int]], sent: float, done: float) -> set[int]:
    """Versions active at some instant of [sent, done], from the flip log (ts, version)."""
    out = set()
    for k, (ts, v) in enumerate(flips):
        next_ts = flips[k + 1][0] if k + 1 < len(flips) else float("inf")
        if ts <= done and next_ts > sent:
            out.add(v)
    return out


def _new_weights(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# -- the test -------------------------------------------------------------------------------------


def test_publications_under_bursty_traffic_and_random_sigkills(launcher, make_fleet, tiny_model):
    seed = int(os.environ.get("LORAFLEET_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    print(f"\nchaos seed {seed} (replay: LORAFLEET_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    t_begin = time.time()
    fleet = make_fleet(launcher, 2)
    model = make_peft_model(tiny_model, r=4, seed=seed)
    rec = Record()
    timeouts = Timeouts(connect=3, upload=30, commit=30, load=30, cutover=10, drain=10)
    answers: list[Answer] = []
    publications: list[dict] = []
    violations: list[str] = []
    stop = threading.Event()
    chaos_done = threading.Event()
    killed: Counter = Counter()

    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token,
                   timeouts=timeouts) as pub:  # fmt: skip
        _new_weights(model, rng.randrange(10**9))
        first = pub.publish(model, name=NAME)
        assert first.version == 1
        loader = threading.Thread(
            target=traffic,
            args=(fleet.router.url, random.Random(rng.random()), stop, answers),
            daemon=True,
        )
        loader.start()

        def run_chaos() -> None:
            try:
                killed.update(chaos(fleet, launcher, rec, random.Random(rng.random()), stop))
            finally:
                chaos_done.set()

        chaoser = threading.Thread(target=run_chaos, daemon=True)
        chaoser.start()
        try:
            while not chaos_done.is_set():
                _new_weights(model, rng.randrange(10**9))
                start = time.time()
                try:
                    result = pub.publish(model, name=NAME)
                    outcome, version = "ok", result.version
                except LorafleetError as exc:
                    outcome, version = f"{type(exc).__name__}: {exc}", None
                end = time.time()
                publications.append({"start": start, "end": end, "outcome": outcome})
                violations += check_after_publication(fleet, rec, start, end, version, outcome)
                time.sleep(rng.uniform(0.0, 0.4))
        finally:
            stop.set()  # traffic stops too: the last checks run on a quiet fleet
            chaoser.join(180)
            loader.join(120)
        assert not chaoser.is_alive() and not loader.is_alive()

        # Every process is back: the loop goes on with nobody's help.
        for i in range(2):
            wait_until(lambda i=i: _ready(fleet.agents[i].url), timeout=120, message="ready")
        _new_weights(model, rng.randrange(10**9))
        final = pub.publish(model, name=NAME)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    served = httpx.post(fleet.router.url + "/v1/completions", json=body, timeout=60)
    assert served.status_code == 200, served.text
    assert served.json()["lorafleet"]["version"] == final.version
    for i, agent in enumerate(fleet.agents):
        recs = [(r["name"], r["version"], r["state"]) for r in fleet.adapters(i)]
        assert recs == [(NAME, final.version, "active")], (i, recs)
        assert staging_files(agent) == [], (i, staging_files(agent))
        dirs = sorted(p.name for p in (agent.spec.data_dir / "adapters" / NAME).iterdir())
        assert dirs == [str(final.version)], (i, dirs)

    # Every response, against the flip log.
    table = router_table(fleet)
    flips = sorted((e["ts"], e["version"]) for e in table["log"] if e["name"] == NAME)
    excused = Counter()
    for a in answers:
        if a.status != 200 and rec.overlaps("router", a.sent, a.done):
            excused["router down"] += 1
            continue
        if a.status != 200:
            alive = [i for i in range(2) if rec.replica_alive(i, a.sent, a.done)]
            if not alive:  # cannot happen with one fault at a time; kept for the definition
                excused["no replica alive"] += 1
                continue
            violations.append(
                f"request [{a.sent - t_begin:.2f}, {a.done - t_begin:.2f}] failed with "
                f"{a.status} while replica(s) {alive} were alive: {a.error}"
            )
            continue
        ok = allowed_versions(flips, a.sent, a.done)
        tag = a.tag or {}
        v = tag.get("version")
        if v not in ok or a.header_version != str(v) or tag.get("engine_model") != f"{NAME}@v{v}":
            violations.append(
                f"request [{a.sent - t_begin:.2f}, {a.done - t_begin:.2f}] served v{v} "
                f"(header {a.header_version}, engine {tag.get('engine_model')}); "
                f"active meanwhile: {sorted(ok)}"
            )
    outcomes = Counter("ok" if p["outcome"] == "ok" else "raised" for p in publications)
    statuses = Counter(a.status for a in answers)
    print(
        f"chaos seed {seed}: {time.time() - t_begin:.1f}s; faults {dict(killed)}; "
        f"outages {[(o.what, round(o.up - o.down, 1)) for o in rec.outages]}; "
        f"publications {dict(outcomes)} (+1 first, +1 final v{final.version}); "
        f"requests {len(answers)} {dict(statuses)}, excused {dict(excused)}"
    )
    for p in publications:
        if p["outcome"] != "ok":
            print(f"  raised at {p['start'] - t_begin:.1f}s: {p['outcome'][:300]}")
    assert not violations, f"seed {seed}:\n" + "\n".join(violations[:20])
    assert sum(killed.values()) >= 2, killed  # the run did inject faults
    assert outcomes["ok"] >= 3, outcomes


def check_after_publication(
    fleet, rec: Record, start: float, end: float, version: int | None, outcome: str
) -> list[str]:
    """The staged-bytes invariant on every agent that was up for the whole publication."""
    problems = []
    table = router_table(fleet)
    entry = table["aliases"].get(NAME)
    active = entry["version"] if entry else None
    if version is not None and active != version:
        problems.append(f"publish() returned v{version} but the router serves v{active}")
    for i, agent in enumerate(fleet.agents):
        if rec.overlaps(f"agent{i}", start, time.time()):
            continue  # killed meanwhile: its restart clears staging; checked at the end
        records = agent_records(fleet, i)
        files = staging_files(agent)
        if files:
            problems.append(f"agent{i} has staging files after a publication: {files}")
        if records is None:
            continue
        engine_hit = rec.overlaps(f"engine{i}", start, time.time())
        for r in records:
            if r["state"] == "staged":
                problems.append(f"agent{i} keeps a staged record after a publication: {r}")
            if r["state"] in ("active", "loaded") or (engine_hit and r["state"] == "retiring"):
                continue
            problems.append(f"agent{i} keeps {r['name']} v{r['version']} {r['state']}: {r}")
        if outcome != "ok" and not engine_hit:
            # Rolled back here: nothing of the failed version is loaded, unless it is active.
            held = {r["version"] for r in records}
            failed_v = (active or 0) + 1
            if failed_v in held:
                problems.append(f"agent{i} still holds v{failed_v} after a failed publication")
    return problems
