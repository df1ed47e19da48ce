"""Pure pieces: the alias store (CAS, versions, leases, persistence), the balancer, the checker."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet.dataplane.balancer import Balancer
from lorafleet.errors import ServiceError
from lorafleet.protocol.router import AliasEvent
from lorafleet.router import table as table_module
from lorafleet.router.table import LOG_FILE, STATE_FILE, AliasStore
from lorafleet.testing.consistency import Observation, check, implied_version


def test_store_cas_versions_and_log(tmp_path):
    s = AliasStore(tmp_path)
    e1 = s.set_alias("p", 1, "p@v1", ["r0"], expected_version=None)
    assert (e1.version, e1.seq) == (1, 1)
    with pytest.raises(ServiceError) as ei:
        s.set_alias("p", 2, "p@v2", ["r0"], expected_version=None)
    assert ei.value.code == "version_conflict"
    with pytest.raises(ServiceError) as ei:
        s.set_alias("p", 1, "p@v1", ["r0"])  # not newer
    assert ei.value.code == "version_conflict"
    s.set_alias("p", 3, "p@v3", ["r0"], expected_version=1)
    s.delete_alias("p")
    assert [(e.seq, e.version) for e in s.table().log] == [(1, 1), (2, 3), (3, None)]
    with pytest.raises(ServiceError) as ei:
        s.delete_alias("p")
    assert ei.value.code == "not_found"


def test_store_leases(tmp_path):
    s = AliasStore(tmp_path)
    s.acquire_lease("p", "a", 60)
    with pytest.raises(ServiceError) as ei:
        s.acquire_lease("p", "b", 60)
    assert ei.value.code == "publish_in_progress" and "'a'" in ei.value.message
    s.acquire_lease("p", "a", 60)  # renew
    with pytest.raises(ServiceError):
        s.set_alias("p", 1, "p@v1", ["r0"])  # no lease_holder while a lease is held
    s.set_alias("p", 1, "p@v1", ["r0"], lease_holder="a")
    with pytest.raises(ServiceError):
        s.release_lease("p", "b")
    s.release_lease("p", "a")
    s.release_lease("p", "a")  # idempotent
    s.acquire_lease("p", "b", 0.01)
    import time

    time.sleep(0.02)
    s.acquire_lease("p", "c", 60)  # b's lease expired


def test_store_persists_atomically(tmp_path):
    s = AliasStore(tmp_path)
    s.set_alias("p", 1, "p@v1", ["r0", "r1"])
    s.acquire_lease("p", "a", 60)
    again = AliasStore(tmp_path)
    assert again.aliases == s.aliases and again.log == s.log and again.seq == 1
    assert again.lease_of("p").holder == "a"
    # no temp files left, and neither file is readable by others
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOG_FILE, STATE_FILE])
    assert {(tmp_path / n).stat().st_mode & 0o777 for n in (LOG_FILE, STATE_FILE)} == {0o600}


def _events(store: AliasStore) -> list[tuple[int, int | None]]:
    return [(e.seq, e.version) for e in store.log]


def test_the_flip_log_survives_a_crash_at_any_point_of_a_write(tmp_path):
    """The log file is appended to before the state file is replaced: an event the state does
    not reach (the crash came between the two) and a line cut short are dropped on start, and
    the next flip starts a line of its own."""
    s = AliasStore(tmp_path)
    s.set_alias("p", 1, "p@v1", ["r0"])
    s.set_alias("p", 2, "p@v2", ["r0"])
    log_file = tmp_path / LOG_FILE
    committed = log_file.read_bytes()
    # A flip whose log line landed and whose state write did not, then a line cut short.
    ghost = AliasEvent(seq=3, ts=1.0, name="p", version=9, engine_name="p@v9")
    log_file.write_bytes(committed + ghost.model_dump_json().encode() + b"\n" + b'{"seq":4,"ts')
    again = AliasStore(tmp_path)
    assert _events(again) == [(1, 1), (2, 2)] and again.aliases["p"].version == 2
    assert log_file.read_bytes() == committed  # rewritten without them
    again.set_alias("p", 3, "p@v3", ["r0"])
    assert _events(AliasStore(tmp_path)) == [(1, 1), (2, 2), (3, 3)]


def test_a_flip_whose_state_write_failed_is_replaced_by_the_next(tmp_path, monkeypatch):
    s = AliasStore(tmp_path)
    s.set_alias("p", 1, "p@v1", ["r0"])
    real = table_module.atomic_write

    def fail(path, data, mode=0o600):
        if path.name == STATE_FILE:
            raise OSError("disk full")
        real(path, data, mode)

    monkeypatch.setattr(table_module, "atomic_write", fail)
    with pytest.raises(OSError):
        s.set_alias("p", 2, "p@v2", ["r0"])  # its line is in the log file, seq 2
    monkeypatch.setattr(table_module, "atomic_write", real)
    assert s.aliases["p"].version == 1 and _events(s) == [(1, 1)]
    s.set_alias("p", 5, "p@v5", ["r0"])  # takes seq 2
    assert _events(AliasStore(tmp_path)) == [(1, 1), (2, 5)]


def test_a_state_file_with_the_log_inside_is_read_and_moved_out(tmp_path):
    """A router before the log file kept the log in its state file."""
    s = AliasStore(tmp_path)
    s.set_alias("p", 1, "p@v1", ["r0"])
    s.set_alias("p", 2, "p@v2", ["r0"])
    doc = json.loads((tmp_path / STATE_FILE).read_text())
    doc["log"] = [e.model_dump() for e in s.log]
    (tmp_path / STATE_FILE).write_text(json.dumps(doc))
    (tmp_path / LOG_FILE).unlink()
    again = AliasStore(tmp_path)
    assert _events(again) == [(1, 1), (2, 2)]
    again.set_alias("p", 3, "p@v3", ["r0"])
    assert json.loads((tmp_path / STATE_FILE).read_text())["log"] == []
    assert _events(AliasStore(tmp_path)) == [(1, 1), (2, 2), (3, 3)]


def test_the_log_file_is_cut_back_to_the_newest_events(tmp_path, monkeypatch):
    monkeypatch.setattr(table_module, "MAX_LOG", 3)
    s = AliasStore(tmp_path)
    for v in range(1, 12):
        s.set_alias("p", v, f"p@v{v}", ["r0"])
        lines = (tmp_path / LOG_FILE).read_bytes().count(b"\n")
        assert lines <= 2 * 3  # rewritten with the newest once it passes twice the cap
    assert _events(s) == [(9, 9), (10, 10), (11, 11)]
    assert _events(AliasStore(tmp_path)) == _events(s)


def test_a_reservation_takes_the_lease_in_the_same_write_or_nothing(tmp_path):
    s = AliasStore(tmp_path)
    assert s.reserve("p", "a", lease_ttl_s=60) == 1
    again = AliasStore(tmp_path)  # both are durable
    assert again.lease_of("p").holder == "a" and again.reserved["p"] == 1
    with pytest.raises(ServiceError) as ei:
        s.reserve("p", "b", lease_ttl_s=60)
    assert ei.value.code == "publish_in_progress"
    s.set_alias("p", 1, "p@v1", ["r0"], lease_holder="a")
    s.release_lease("p", "a")
    # A number that is not newer is refused, and the lease is not taken either.
    with pytest.raises(ServiceError) as ei:
        s.reserve("p", "b", 1, lease_ttl_s=60)
    assert ei.value.code == "version_conflict"
    assert "not newer than the active version 1" in ei.value.message
    assert s.lease_of("p") is None and AliasStore(tmp_path).lease_of("p") is None


def test_a_flip_gives_the_lease_back_in_its_own_write_or_not_at_all(tmp_path):
    s = AliasStore(tmp_path)
    assert s.reserve("p", "a", lease_ttl_s=60) == 1
    with pytest.raises(ServiceError) as ei:  # refused (CAS): the lease stays
        s.set_alias(
            "p", 1, "p@v1", ["r0"], expected_version=7, lease_holder="a", release_lease=True
        )
    assert ei.value.code == "version_conflict"
    assert s.lease_of("p").holder == "a" and AliasStore(tmp_path).lease_of("p").holder == "a"
    s.set_alias("p", 1, "p@v1", ["r0"], lease_holder="a", release_lease=True)
    again = AliasStore(tmp_path)  # the flip and the release are one durable write
    assert (
        s.lease_of("p") is None and again.lease_of("p") is None and again.aliases["p"].version == 1
    )
    assert s.reserve("p", "b", lease_ttl_s=60) == 2  # the next publisher need not wait
    with pytest.raises(ServiceError) as ei:  # another's lease is not given back by a flip
        s.set_alias("p", 2, "p@v2", ["r0"], lease_holder="a", release_lease=True)
    assert ei.value.code == "publish_in_progress" and s.lease_of("p").holder == "b"
    s.set_alias("p", 2, "p@v2", ["r0"], lease_holder="b")  # without it, the lease stays
    assert s.lease_of("p").holder == "b"


def test_the_written_log_follows_appends_trims_and_deletions(tmp_path, monkeypatch):
    # The state file's log is extended, not serialized again, at each write: what a restart
    # reads must still be the log, exactly, as it is appended to and capped.
    monkeypatch.setattr("lorafleet.router.table.MAX_LOG", 5)
    s = AliasStore(tmp_path)
    s.acquire_lease("p", "a", 60)
    for i in range(12):
        v = s.reserve("p", "a")
        s.set_alias("p", v, f"p@v{v}", ["r0"], lease_holder="a")
        if i % 4 == 3:
            s.delete_alias("p", "a")
        again = AliasStore(tmp_path)
        assert again.log == s.log and again.seq == s.seq and len(again.log) <= 5
    assert [e.seq for e in AliasStore(tmp_path).log] == list(range(s.seq - 4, s.seq + 1))


def test_balancer_fewest_outstanding_and_sessions():
    b = Balancer(["http://a", "http://b"])
    for i, r in enumerate(b.replicas):
        r.replica_id, r.engine_url, r.healthy = f"r{i}", f"http://e{i}", True
    b.reindex()
    cands = b.candidates(["r0", "r1"])
    b.replicas[0].inflight = 3
    assert b.pick(cands).replica_id == "r1"
    first = b.pick(cands, "s1")
    b.replicas[0].inflight, b.replicas[1].inflight = 0, 0
    for _ in range(5):
        assert b.pick(cands, "s1") is first  # sticky even when the other is idle
    first.healthy = False
    assert b.pick(b.candidates(["r0", "r1"]), "s1") is not first  # re-placed
    assert b.candidates(["ghost"]) == []


def test_balancer_drain_waits_for_zero():
    async def go() -> None:
        b = Balancer([])
        b.begin(("p", 1))
        assert await b.wait_drained("p", 1, 0.05) == 1
        waiter = asyncio.ensure_future(b.wait_drained("p", 1, 5))
        await asyncio.sleep(0.01)
        b.end(("p", 1))
        assert await waiter == 0
        assert await b.wait_drained("p", 2, 0) == 0

    asyncio.run(go())


# --- the consistency checker on synthetic traces -------------------------------------------------

LOG = [
    AliasEvent(seq=1, ts=10.0, name="p", version=1, engine_name="p@v1"),
    AliasEvent(seq=2, ts=20.0, name="p", version=2, engine_name="p@v2"),
    AliasEvent(seq=3, ts=30.0, name="p", version=3, engine_name="p@v3"),
]


def obs(i, t, v, first=None, models=None, status=200, adapter="p", error=None):
    return Observation(
        index=i, t_send=t, t_first=first or t + 0.01, t_done=(first or t) + 0.02,
        status=status, adapter=adapter, version=v, replica="r0",
        engine_models=models if models is not None else [f"p@v{v}"], error=error,
    )  # fmt: skip


def test_checker_accepts_a_clean_trace():
    trace = [obs(0, 11, 1), obs(1, 19.99, 2, first=20.01), obs(2, 25, 2), obs(3, 31, 3)]
    assert check(trace, LOG, "p") == []
    assert implied_version("p@v12", "p") == 12 and implied_version("q@v1", "p") is None
    # SGLang's OpenAI routes answer with the served base name in front.
    assert implied_version("tiny:p@v3", "p") == 3 and implied_version("tiny:q@v3", "p") is None
    assert implied_version("p", "p") is None


def test_checker_catches_each_violation():
    trace = [
        obs(0, 12, 1, status=503, error="no replica"),  # failed
        obs(1, 25, 1),  # stale: v2 was active at send
        obs(2, 15, 3),  # from the future
        obs(3, 25, 2, models=["p@v3"]),  # tag v2, engine v3
        obs(4, 25, 2, models=["p@v2", "p@v1"]),  # two versions in one stream
        obs(5, 25, None, adapter=None, models=[]),  # no tag
    ]
    kinds = [(v.kind, v.index) for v in check(trace, LOG, "p")]
    assert kinds == [
        ("failed", 0),
        ("wrong_version", 1),
        ("wrong_version", 2),
        ("mixed_versions", 3),
        ("mixed_versions", 4),
        ("untagged", 5),
    ]


def test_checker_slack_allows_the_previous_version_briefly():
    late = [obs(0, 20.03, 1)]
    assert [v.kind for v in check(late, LOG, "p")] == ["wrong_version"]
    assert check(late, LOG, "p", slack_s=0.05) == []
    assert [v.kind for v in check([obs(0, 20.2, 1)], LOG, "p", slack_s=0.05)] == ["wrong_version"]


def test_the_client_sends_the_api_key_on_the_data_plane_and_the_token_on_control():
    import httpx

    from lorafleet.clients.router import AsyncRouterClient
    from lorafleet.errors import Unauthorized

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/finish_session":
            if request.headers.get("authorization") not in (None, "Bearer key"):
                return httpx.Response(
                    401, json={"error": {"code": "unauthorized", "message": "wrong API key"}}
                )
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(200, json={"aliases": {}, "log": []})

    async def go(token: str | None, api_key: str | None) -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncRouterClient("http://router/", token, http, api_key=api_key) as c:
            await c.finish_session("episode 1")
            await c.table()
        await http.aclose()

    asyncio.run(go("ctl", "key"))
    finish, table = seen
    assert (finish.method, finish.url.path) == ("POST", "/finish_session")
    assert finish.url.params["session_id"] == "episode 1"
    assert finish.headers["authorization"] == "Bearer key"
    assert table.headers["authorization"] == "Bearer ctl"
    asyncio.run(go("ctl", None))  # an open data plane: no key, and never the control token
    assert "authorization" not in seen[-2].headers
    with pytest.raises(Unauthorized, match="wrong API key"):
        asyncio.run(go("ctl", "other"))
