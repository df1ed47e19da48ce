"""Sessions: the replica a session sticks to and, per name, the version it started on.

A session is named by the client (the ``X-Session-ID`` header). Its first request for a name
whose policy pins sessions fixes the version the session gets from then on (``pin``); every
request of a session prefers the replica that served it before (``replica``), for the engine's
prefix cache.

A session lives until ``finish_session`` or until it has been idle for ``idle_s``: then its next
request starts fresh, on the newest version. SkyRL names a session
``<instance_id>_<repetition_id>``, so the same id comes back every epoch; without an idle
lifetime a session whose ``finish_session`` was lost would keep its old version, or be refused
once that version left the retention window, for as long as the router remembered it.

A new session costs no round trip: everything here is synchronous and local. With data-plane
copies, the control plane's sessions are the **authority**: copies report the pins they make
(and, while a session is in use, that it still is); the first pin of a session and name stands
(``merge``); the control plane ends sessions (idle, or finished anywhere) and every copy learns
pins and ends from its log (``adopt``), so a session's pin holds whichever copy its next request
reaches, and it starts fresh everywhere at once. A copy never ends a session by its own clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_IDLE_S", "MAX_SESSIONS", "Pin", "Sessions"]

# Sessions are a cache: the least recently used fall out first.
MAX_SESSIONS = 100_000
DEFAULT_IDLE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Pin:
    """Session ``session`` started on ``version`` of ``name``; ``name`` None: it ended."""

    session: str
    name: str | None
    version: int | None


@dataclass(slots=True)
class _Session:
    seen: float
    reported: float = 0.0
    """When it was last reported to the control plane (a copy reports use while in use)."""
    replica: Any = None
    """The ``Replica`` it sticks to (``balancer.py``)."""
    pins: dict[str, int] = field(default_factory=dict)


class Sessions:
    """Sticky replicas and version pins, with an idle lifetime (see the module docstring).

    ``authority``: these sessions end by their own clock (the control plane, or a router with no
    copies); otherwise only when the authority says (``adopt`` of an end)."""

    def __init__(
        self,
        idle_s: float = DEFAULT_IDLE_S,
        *,
        authority: bool = True,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.authority = authority
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_id: OrderedDict[str, _Session] = OrderedDict()
        self._news: list[Pin] = []

    def __contains__(self, session: str) -> bool:
        return self._live(session, touch=False) is not None

    def __len__(self) -> int:
        return len(self._by_id)

    def _live(self, session: str, *, touch: bool = True) -> _Session | None:
        s = self._by_id.get(session)
        if s is None:
            return None
        now = self._clock()
        if self.authority and now - s.seen > self.idle_s:
            self._end(session)  # idle too long: it starts fresh
            return None
        if touch:
            s.seen = now
            self._by_id.move_to_end(session)
        return s

    def _get(self, session: str) -> _Session:
        s = self._live(session)
        if s is None:
            s = self._by_id[session] = _Session(seen=self._clock())
            if len(self._by_id) > self.max_sessions:
                self._by_id.popitem(last=False)
        return s

    def _end(self, session: str) -> None:
        if self._by_id.pop(session, None) is not None:
            self._report(Pin(session, None, None))

    def _report(self, pin: Pin) -> None:
        self._news.append(pin)
        if len(self._news) > self.max_sessions:
            # Nobody takes them (a router with no copies): keep the newest only.
            del self._news[: len(self._news) - self.max_sessions]

    # --- stickiness ----------------------------------------------------------------------------

    def replica(self, session: str) -> Any:
        """The replica ``session`` used last, if it is still remembered."""
        s = self._live(session)
        return None if s is None else s.replica

    def stick(self, session: str, replica: object) -> None:
        self._get(session).replica = replica

    def unstick(self, replica: object) -> None:
        """No session sticks to ``replica`` any more (it moved or left)."""
        for s in self._by_id.values():
            if s.replica is replica:
                s.replica = None

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, session: str, name: str, newest: int) -> int:
        """The version ``session`` uses for ``name``: the one it started on, else ``newest``
        (which it is pinned to from now on)."""
        s = self._get(session)
        got = s.pins.get(name)
        if got is None:
            got = s.pins[name] = newest
            self._report(Pin(session, name, newest))
            s.reported = s.seen
        elif not self.authority and s.seen - s.reported > self.idle_s / 8:
            # Still in use here: the authority must not end it as idle.
            self._report(Pin(session, name, got))
            s.reported = s.seen
        return got

    def pinned(self, session: str, name: str) -> int | None:
        """The version ``session`` started on for ``name``, if it has one (no new pin)."""
        s = self._live(session, touch=False)
        return None if s is None else s.pins.get(name)

    def take_news(self) -> list[Pin]:
        """Pins made (or used again) and sessions ended here since the last call."""
        news, self._news = self._news, []
        return news

    def sweep(self) -> int:
        """The authority ends every session idle past its lifetime; how many."""
        if not self.authority:
            return 0
        now, ended = self._clock(), 0
        while self._by_id:
            session, s = next(iter(self._by_id.items()))
            if now - s.seen <= self.idle_s:
                break
            self._end(session)
            ended += 1
        return ended

    def adopt(self, pins: Iterable[Pin]) -> None:
        """The authority's word: pins (they replace one made here for the same session and
        name: the first pin stands) and ends."""
        for p in pins:
            if p.name is None:
                self._by_id.pop(p.session, None)
                continue
            s = self._by_id.get(p.session)
            if s is None:
                s = self._by_id[p.session] = _Session(seen=self._clock(), reported=self._clock())
            s.pins[p.name] = p.version  # type: ignore[assignment]

    def merge(self, pins: Iterable[Pin]) -> list[Pin]:
        """What copies reported, into the authority: the first pin of a session and name
        stands, a use keeps it alive, an end ends it. Returns what every copy must adopt: new
        pins, ends, and this side's pin where a report disagreed with it."""
        out: list[Pin] = []
        for p in pins:
            if p.name is None:
                if self._by_id.pop(p.session, None) is not None:
                    out.append(p)
                continue
            s = self._get(p.session)
            got = s.pins.get(p.name)
            if got is None:
                s.pins[p.name] = p.version  # type: ignore[assignment]
                out.append(p)
            elif got != p.version:
                out.append(Pin(p.session, p.name, got))
        return out

    def forget(self, session: str) -> None:
        """``finish_session``: its replica and its versions are forgotten (everywhere, once the
        authority hears of it)."""
        self._end(session)
