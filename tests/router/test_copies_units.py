"""The control plane's bookkeeping of its data-plane copies, and a copy's sessions, in-process
with a fake clock: acknowledgements, fencing, pins that hold across copies, idle sessions."""

from __future__ import annotations

import asyncio

from lorafleet.dataplane.sessions import Pin, Sessions
from lorafleet.protocol.router import AliasEntry, CopyReport, PinRecord, RoutableVersion
from lorafleet.router.copies import Copies


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _entry(version: int) -> AliasEntry:
    ref = RoutableVersion(version=version, engine_name=f"p@v{version}", replicas=["r0"])
    return AliasEntry(
        name="p",
        version=version,
        engine_name=ref.engine_name,
        replicas=["r0"],
        seq=version,
        keep_versions=2,
        routable=[ref],
    )


def _copies(clock: Clock, table: dict) -> Copies:
    return Copies(lambda: table, lambda: ["http://a"], Sessions(clock=clock), clock=clock)


def test_a_session_idle_past_its_lifetime_starts_fresh():
    clock = Clock()
    s = Sessions(idle_s=60, clock=clock)
    assert s.pin("episode-1", "p", 3) == 3
    clock.t += 59
    assert s.pin("episode-1", "p", 4) == 3  # in use: still the version it started on
    clock.t += 59
    assert s.pin("episode-1", "p", 5) == 3  # each use renews its lifetime
    clock.t += 61
    assert "episode-1" not in s
    assert s.pin("episode-1", "p", 6) == 6  # idle too long: a new session, on the newest


def test_the_first_pin_of_a_session_stands_and_a_disagreeing_copy_is_corrected():
    clock = Clock()
    authority = Sessions(clock=clock)
    assert authority.merge([Pin("s", "p", 1)]) == [Pin("s", "p", 1)]
    # Another copy pinned the same session later, on the newer version: ours is sent back.
    assert authority.merge([Pin("s", "p", 2)]) == [Pin("s", "p", 1)]
    assert authority.merge([Pin("s", "p", 1)]) == []  # agreeing: nothing to tell anyone
    copy = Sessions(clock=clock)
    copy.pin("s", "p", 2)
    copy.adopt([Pin("s", "p", 1)])
    assert copy.pin("s", "p", 2) == 1


def test_pins_made_on_one_copy_reach_the_others_through_the_log():
    clock = Clock()
    table = {"p": _entry(1)}
    copies = _copies(clock, table)
    a = copies.report(CopyReport(copy_id="a", pins=[PinRecord(session="s", name="p", version=1)]))
    b = copies.report(CopyReport(copy_id="b"))
    snap = copies.snapshot(b, cursor=0)
    assert [(p.session, p.version) for p in snap.pins] == [("s", 1)]
    # b adopted up to the cursor: nothing again; a sees its own pin in the log, harmlessly.
    b = copies.report(CopyReport(copy_id="b", epoch=copies.epoch, pin_cursor=snap.pin_cursor))
    assert copies.snapshot(b, cursor=snap.pin_cursor).pins == []
    assert len(copies.snapshot(a, cursor=0).pins) == 1


def test_a_flip_waits_for_every_acknowledgement_and_fences_a_silent_copy():
    async def main() -> None:
        clock = Clock()
        table = {"p": _entry(1)}
        copies = _copies(clock, table)
        copies.report(CopyReport(copy_id="a", epoch=copies.epoch, acked=copies.seq))
        copies.report(CopyReport(copy_id="b", epoch=copies.epoch, acked=copies.seq))
        seq = copies.bump()
        waiting = asyncio.ensure_future(copies.wait_acked(seq))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # neither acknowledged yet
        copies.report(CopyReport(copy_id="a", epoch=copies.epoch, acked=seq))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # b is silent, but within its lease
        assert copies.lagging(seq) == ["b"]
        clock.t += copies.lease_s + copies.margin_s + 0.01
        assert await asyncio.wait_for(waiting, 5) == ["b"]  # fenced: it refuses by now
        copies.report(CopyReport(copy_id="a", epoch=copies.epoch, acked=seq))
        status = {c.copy_id: c for c in copies.status().copies}
        assert status["b"].fenced and not status["a"].fenced and status["a"].current

    asyncio.run(main())


def test_a_copy_of_another_epoch_gets_the_whole_table_again():
    clock = Clock()
    table = {"p": _entry(1)}
    copies = _copies(clock, table)
    c = copies.report(CopyReport(copy_id="a", epoch="an-older-control-plane", acked=99))
    snap = copies.snapshot(c, cursor=5)
    assert snap.aliases is not None and "p" in snap.aliases and snap.agents == ["http://a"]
    assert snap.epoch == copies.epoch
    c = copies.report(CopyReport(copy_id="a", epoch=copies.epoch, acked=snap.seq))
    assert copies.snapshot(c, cursor=snap.pin_cursor).aliases is None  # acknowledged: a heartbeat


def test_a_drain_counts_every_copy():
    async def main() -> None:
        clock = Clock()
        copies = _copies(clock, {})
        copies.report(CopyReport(copy_id="a", epoch=copies.epoch, acked=copies.seq))
        deadline = clock.t + 60
        draining = asyncio.ensure_future(copies.wait_drained("p", 1, deadline))
        await asyncio.sleep(0.02)
        assert ("p", 1) in copies.draining and not draining.done()
        report = {"copy_id": "a", "epoch": copies.epoch, "acked": copies.seq}
        copies.report(CopyReport(**report, draining=[{"name": "p", "version": 1, "inflight": 2}]))
        await asyncio.sleep(0.02)
        assert not draining.done() and copies.count("p", 1) == 2
        copies.report(CopyReport(**report, draining=[{"name": "p", "version": 1, "inflight": 0}]))
        assert await asyncio.wait_for(draining, 5) == 0
        assert ("p", 1) not in copies.draining

    asyncio.run(main())
