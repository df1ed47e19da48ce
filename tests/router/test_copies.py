"""No single router: data-plane copies of one control plane, each process killed or frozen.

Real processes: two reference engines with one agent each, a router (the control plane, with a
state directory), and data-plane copies: two workers sharing one socket (``--workers 2``, the
kill test) and two copies on their own ports (``a`` and ``b``, so a test can reach the one it
froze). Load comes from the unmodified openai client, in bursts with idle gaps.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from lorafleet.errors import LorafleetError
from lorafleet.launch import Launcher, Server
from lorafleet.publisher import Publisher
from lorafleet.router.table import STATE_FILE
from lorafleet.testing import make_peft_adapter, start_dataplane, start_router, wait_until

NAME = "policy"


@dataclass
class Copies:
    fleet: object
    router: Server
    shared: Server
    a: Server
    b: Server
    adapters: list[Path]
    token: str
    launcher: Launcher
    next_adapter: int = 0

    def ctl(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def copy_list(self) -> dict:
        r = httpx.get(self.router.url + "/v1/control/copies", headers=self.ctl(), timeout=10)
        r.raise_for_status()
        return r.json()

    def copies(self) -> list[dict]:
        return self.copy_list()["copies"]

    def pids(self, server: Server) -> list[int]:
        return [c["pid"] for c in self.copies() if c["url"] == server.url]

    def all_current(self, n: int = 4) -> bool:
        copies = self.copies()
        return sum(1 for c in copies if c["current"]) >= n

    def publish(self, **kw) -> int:
        adapter = self.adapters[self.next_adapter % len(self.adapters)]
        self.next_adapter += 1
        with Publisher(agents=self.fleet.agent_urls, router=self.router.url, token=self.token) as p:
            return p.publish(adapter, name=kw.pop("name", NAME), **kw).version


@pytest.fixture(scope="module")
def copies(make_fleet, tiny_model, tmp_path_factory) -> Iterator[Copies]:
    root = tmp_path_factory.mktemp("copies")
    adapters = [make_peft_adapter(tiny_model, root / f"ad{i}", seed=i) for i in range(3)]
    with Launcher(root / "logs") as launcher:
        fleet = make_fleet(launcher, n=2, router=True)
        router = fleet.router
        token = fleet.token
        shared = start_dataplane(launcher, router, token=token, workers=2, health_interval=0.2)
        a = start_dataplane(launcher, router, token=token, health_interval=0.2)
        b = start_dataplane(launcher, router, token=token, health_interval=0.2)
        c = Copies(fleet, router, shared, a, b, adapters, token, launcher)
        wait_until(c.all_current, timeout=120, message="four data-plane copies current")
        c.publish()
        yield c


def _version(base_url: str, *, session: str | None = None, model: str = NAME) -> tuple[int, dict]:
    """One completion on a fresh connection: (status, body)."""
    headers = {"Connection": "close"}
    if session is not None:
        headers["X-Session-ID"] = session
    r = httpx.post(
        base_url + "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    return r.status_code, r.json()


@dataclass
class Load:
    """The openai client in bursts with idle gaps, from a few threads, until stopped."""

    base_url: str
    threads: int = 4
    results: list[tuple[float, str, int | None]] = field(default_factory=list)
    """(time, "ok" or the error, the version that answered)."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", timeout=60)
        while not self._stop.is_set():
            for _ in range(rng.randint(1, 6)):
                try:
                    out = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
                    self.results.append(
                        (time.monotonic(), "ok", out.model_extra["lorafleet"]["version"])
                    )
                except openai.OpenAIError as exc:
                    self.results.append((time.monotonic(), repr(exc), None))
            self._stop.wait(rng.uniform(0.0, 0.2))

    @contextmanager
    def running(self) -> Iterator[Load]:
        pool = concurrent.futures.ThreadPoolExecutor(self.threads)
        futures = [pool.submit(self._run, i) for i in range(self.threads)]
        try:
            yield self
        finally:
            self._stop.set()
            for f in futures:
                f.result()
            pool.shutdown()

    def served(self) -> int:
        return sum(1 for _, what, _ in self.results if what == "ok")

    def failures(self) -> list[str]:
        return [what for _, what, _ in self.results if what != "ok"]


def test_a_flip_is_on_every_copy_before_publish_returns(copies):
    v = copies.publish()
    for server in (copies.a, copies.b, *[copies.shared] * 8):
        status, body = _version(server.url)
        assert status == 200 and body["lorafleet"]["version"] == v, body
    assert all(c["acked"] >= 1 for c in copies.copies())


def test_killing_one_of_two_copies_on_a_socket_fails_no_request(copies):
    victim = copies.pids(copies.shared)[0]
    with Load(copies.shared.url).running() as load:
        wait_until(lambda: load.served() >= 20, timeout=120, message="load under way")
        os.kill(victim, signal.SIGKILL)
        before = load.served()
        wait_until(lambda: load.served() >= before + 40, timeout=120, message="load goes on")
    # The openai client resends what the dead copy was answering; nothing else could fail.
    assert load.failures() == []
    # The supervisor started a new copy on the same socket; it syncs and serves.
    wait_until(
        lambda: len(copies.pids(copies.shared)) == 2 and victim not in copies.pids(copies.shared),
        timeout=120,
        message="a new copy in the dead one's place",
    )


def test_a_copy_frozen_during_a_flip_is_fenced_and_never_serves_the_old_newest(copies):
    old = copies.publish()
    frozen = copies.pids(copies.a)[0]
    os.kill(frozen, signal.SIGSTOP)
    try:
        new = copies.publish()
        # publish() returned: copy a acknowledged nothing, so it was fenced first.
        listed = copies.copy_list()
        status = {c["pid"]: c for c in listed["copies"]}
        assert status[frozen]["fenced"] and status[frozen]["acked"] < listed["seq"]
    finally:
        os.kill(frozen, signal.SIGCONT)
    seen = []
    for _ in range(30):
        status, body = _version(copies.a.url)
        if status == 200:
            seen.append(body["lorafleet"]["version"])
        else:
            assert status == 503 and body["error"]["code"] == "table_stale", body
    assert old not in seen and seen and set(seen) == {new}


def test_the_control_plane_killed_under_load_serving_goes_on_then_publications_resume(copies):
    current = copies.publish()
    with Load(copies.b.url).running() as load:
        wait_until(lambda: load.served() >= 10, timeout=120, message="load under way")
        copies.router.proc.kill()
        before = load.served()
        wait_until(lambda: load.served() >= before + 30, timeout=120, message="serving goes on")
        # No control plane: a publication fails, saying so, and changes nothing.
        with pytest.raises(LorafleetError) as refused:
            copies.publish()
        assert copies.router.url in str(refused.value) or "unreachable" in str(refused.value)
        down = load.served()
        copies.launcher.restart(copies.router)
        wait_until(copies.all_current, timeout=120, message="the copies synced with the new epoch")
        wait_until(lambda: load.served() >= down + 10, timeout=120, message="load after restart")
    assert load.failures() == []
    assert {v for _, _, v in load.results} == {current}
    # The reservation counter survived: no number is reused, none goes backward.
    assert copies.publish() > current
    status, body = _version(copies.b.url)
    assert status == 200 and body["lorafleet"]["version"] > current


def test_the_control_plane_killed_mid_flip_leaves_no_mix(copies):
    before = copies.publish()
    state = Path(copies.router.spec.state_dir) / STATE_FILE
    # Copy b frozen: the control plane makes the flip durable, then waits out b's lease before
    # it answers; it is killed in that window, so the Publisher never hears back.
    frozen = copies.pids(copies.b)[0]
    os.kill(frozen, signal.SIGSTOP)
    outcome: list[object] = []
    publishing = threading.Thread(target=lambda: outcome.append(_try_publish(copies)))
    try:
        publishing.start()
        wait_until(
            lambda: json.loads(state.read_text())["aliases"][NAME]["version"] > before,
            timeout=120,
            message="the flip is durable",
        )
        copies.router.proc.kill()
        publishing.join(120)
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert isinstance(outcome[0], LorafleetError), outcome  # the answer was lost
    copies.launcher.restart(copies.router)
    wait_until(copies.all_current, timeout=120, message="the copies synced with the new epoch")
    flipped = json.loads(state.read_text())["aliases"][NAME]["version"]
    assert flipped > before
    # Completed everywhere: every copy serves it, and every agent holds it.
    for server in (copies.a, copies.b, copies.shared):
        status, body = _version(server.url)
        assert status == 200 and body["lorafleet"]["version"] == flipped, body
    for i in range(2):
        assert any(r["name"] == NAME and r["version"] == flipped for r in copies.fleet.adapters(i))


def _try_publish(copies: Copies) -> object:
    try:
        return copies.publish()
    except LorafleetError as exc:
        return exc


def test_a_sessions_pin_holds_on_every_copy(copies):
    name = "pinned"
    v1 = copies.publish(name=name, keep_versions=2, sessions="pin")
    session = f"episode-{random.randrange(1 << 30)}"
    status, body = _version(copies.a.url, session=session, model=name)
    assert status == 200 and body["lorafleet"]["version"] == v1
    v2 = copies.publish(name=name, keep_versions=2, sessions="pin")
    for server in (copies.b, copies.a, copies.shared, copies.b):
        status, body = _version(server.url, session=session, model=name)
        assert status == 200 and body["lorafleet"]["version"] == v1, (server.url, body)
    status, body = _version(copies.b.url, session=session + "-new", model=name)
    assert body["lorafleet"]["version"] == v2


def _sessions(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("lorafleet_router_sessions "))
    return float(line.split()[1])


def test_a_session_reused_after_its_idle_lifetime_starts_fresh(copies, tmp_path):
    """The control plane ends a session idle past its lifetime, on every copy at once."""
    name = "idle"
    router = start_router(
        copies.launcher,
        copies.fleet.agents,
        tmp_path / "router",
        token=copies.token,
        health_interval=0.2,
        extra=("--session-idle", "1"),
    )
    copy = start_dataplane(copies.launcher, router, token=copies.token, health_interval=0.2)
    try:
        with Publisher(agents=copies.fleet.agent_urls, router=router.url, token=copies.token) as p:
            v1 = p.publish(copies.adapters[0], name=name, keep_versions=2, sessions="pin").version
            session = "instance-7_0"  # SkyRL's <instance_id>_<repetition_id>: back next epoch
            status, body = _version(copy.url, session=session, model=name)
            assert status == 200 and body["lorafleet"]["version"] == v1
            v2 = p.publish(copies.adapters[1], name=name, keep_versions=2, sessions="pin").version
            status, body = _version(copy.url, session=session, model=name)
            assert body["lorafleet"]["version"] == v1  # in use: it keeps its version
            # Unused for its lifetime: ended by the control plane, then on the copy.
            wait_until(lambda: _sessions(router) == 0, timeout=60, message="ended at the router")
            wait_until(lambda: _sessions(copy) == 0, timeout=60, message="ended on the copy")
            status, body = _version(copy.url, session=session, model=name)
            assert status == 200 and body["lorafleet"]["version"] == v2
    finally:
        copy.stop()
        router.stop()


def test_a_front_forwards_generation_to_the_copies(copies, tmp_path):
    """``lorafleet front --inference``: generation goes to a copy, control to the router; a
    session pinned through one front's copy holds through another front's copy."""
    from lorafleet.front.service import FrontConfig
    from tests.front.skyrl_helpers import serving

    name = "pinned"  # the module's engines hold 8 adapters: session tests share one name
    t1, t2 = (f"trajectory-{random.randrange(1 << 30)}" for _ in range(2))
    v1 = copies.publish(name=name, keep_versions=2, sessions="pin")

    def front(copy: Server):
        return serving(
            FrontConfig(
                agents=copies.fleet.agent_urls,
                router=copies.router.url,
                inference=copy.url,
                shared_dirs=[tmp_path],
                fleet_token=copies.token,
            )
        )

    def served_by(copy: Server) -> int:
        return sum(c["requests"] for c in copies.copies() if c["url"] == copy.url)

    with front(copies.a) as via_a, front(copies.b) as via_b:
        before = served_by(copies.a)
        status, body = _version(via_a, session=t1, model=name)
        assert status == 200 and body["lorafleet"]["version"] == v1
        wait_until(lambda: served_by(copies.a) > before, timeout=30, message="copy a served it")
        v2 = copies.publish(name=name, keep_versions=2, sessions="pin")
        status, body = _version(via_b, session=t1, model=name)
        assert status == 200 and body["lorafleet"]["version"] == v1
        status, body = _version(via_b, session=t2, model=name)
        assert status == 200 and body["lorafleet"]["version"] == v2


def test_a_session_finished_on_one_copy_ends_everywhere(copies):
    """``/finish_session`` on a copy answers once the control plane has the end; every other
    copy then starts the session again on the newest version."""
    name = "pinned"
    v1 = copies.publish(name=name, keep_versions=2, sessions="pin")
    session = f"instance-{random.randrange(1 << 30)}_1"
    for server in (copies.a, copies.b):
        assert _version(server.url, session=session, model=name)[1]["lorafleet"]["version"] == v1
    v2 = copies.publish(name=name, keep_versions=2, sessions="pin")
    r = httpx.post(copies.a.url + "/finish_session", params={"session_id": session}, timeout=30)
    assert r.status_code == 200
    # The control plane took it before the answer: its own data plane starts the session fresh.
    assert _version(copies.router.url, session=session, model=name)[1]["lorafleet"]["version"] == v2
    wait_until(
        lambda: (
            _version(copies.b.url, session=session, model=name)[1]["lorafleet"]["version"] == v2
        ),
        timeout=30,
        message="copy b ended the session",
    )


def _unread_requests(port: int) -> int:
    """Connections to 127.0.0.1:``port`` holding bytes its server has not read (requests a
    stopped server holds), from the kernel's table of TCP sockets."""
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        # "0100007F:1F90", the state (01: established), "tx_queue:rx_queue", all in hex
        local, state, queues = fields[1], fields[3], fields[4]
        if int(local.split(":")[1], 16) == port and state == "01":
            held += int(queues.split(":")[1], 16) > 0
    return held


def test_removing_a_replica_drains_the_requests_copies_have_on_it(copies):
    """A leaving replica is forgotten only once the copies' requests on it have finished: the
    router's own count is 0 here (no load goes through it), so only the copies' counts can
    hold the drain until the stopped engine resumes. None of the requests fails."""
    fleet = copies.fleet
    leaving = fleet.agents[1].url
    ctl = httpx.Client(base_url=copies.router.url, headers=copies.ctl(), timeout=60)
    rid = next(
        r["replica_id"]
        for r in ctl.get("/v1/control/replicas").json()["replicas"]
        if r["agent_url"].rstrip("/") == leaving.rstrip("/")
    )
    engine = fleet.engines[1]
    # Both replicas in copy a's rotation first: one an earlier test left out would get none of
    # the requests below, and the drain would rightly have nothing to wait for.
    wait_until(
        lambda: any(
            c["url"] == copies.a.url and c["current"] and c["healthy_replicas"] == 2
            for c in copies.copies()
        ),
        timeout=60,
        message="copy a routing to both replicas",
    )
    pool = concurrent.futures.ThreadPoolExecutor(6)
    engine.proc.signal(signal.SIGSTOP)  # what reaches it now stays in flight on copy a
    try:
        futures = [pool.submit(_version, copies.a.url) for _ in range(6)]
        # Least-loaded spreading sends some to the stopped engine; the rest answer. Held is
        # read from the kernel: requests still running on a busy replica 0 are not held.
        port = httpx.URL(engine.url).port
        wait_until(
            lambda: sum(f.done() for f in futures) >= 1 and _unread_requests(port) >= 1,
            timeout=60,
            message="requests answered by replica 0 and held by the stopped replica 1",
        )
        answer: dict = {}

        def remove() -> None:
            answer["r"] = ctl.delete(f"/v1/control/replicas/{rid}", params={"drain_s": 60})
            answer["at"] = time.monotonic()

        remover = threading.Thread(target=remove)
        remover.start()
        # Room for a drain that ignored the copies to answer early (the assertion below); a
        # correct one cannot answer before the engine resumes, however long this takes.
        time.sleep(1.0)
        resumed = time.monotonic()
    finally:
        engine.proc.signal(signal.SIGCONT)
    remover.join(90)
    assert answer["r"].status_code == 200, answer["r"].text
    assert answer["r"].json()["inflight"] == 0 and answer["at"] > resumed
    try:
        assert [f.result(timeout=60)[0] for f in futures] == [200] * 6
    finally:
        pool.shutdown()
        # The module's fleet is put back: the replica rejoins and catch-up feeds it.
        assert ctl.post("/v1/control/replicas", json={"agent_url": leaving}).status_code == 201
        wait_until(
            lambda: any(
                r["agent_url"].rstrip("/") == leaving.rstrip("/") and r["healthy"]
                for r in ctl.get("/v1/control/replicas").json()["replicas"]
            ),
            timeout=120,
            message="the replica back in the fleet",
        )
        ctl.close()
