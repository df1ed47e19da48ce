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

Everything here is synchronous and local: a new session costs no round trip. The control plane
learns new pins in each copy's next sync (``take_new_pins``) and hands every copy the pins the
others made (``adopt``), so a session's pin holds whichever copy its next request reaches.
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
    """Session ``session`` started on ``version`` of ``name``."""

    session: str
    name: str
    version: int


@dataclass(slots=True)
class _Session:
    seen: float
    replica: Any = None
    """The ``Replica`` it sticks to (``balancer.py``)."""
    pins: dict[str, int] = field(default_factory=dict)


class Sessions:
    """Sticky replicas and version pins, with an idle lifetime (see the module docstring)."""

    def __init__(
        self,
        idle_s: float = DEFAULT_IDLE_S,
        *,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_id: OrderedDict[str, _Session] = OrderedDict()
        self._new: list[Pin] = []

    def __contains__(self, session: str) -> bool:
        return self._live(session, touch=False) is not None

    def __len__(self) -> int:
        return len(self._by_id)

    def _live(self, session: str, *, touch: bool = True) -> _Session | None:
        s = self._by_id.get(session)
        if s is None:
            return None
        now = self._clock()
        if now - s.seen > self.idle_s:
            del self._by_id[session]  # idle too long: it starts fresh
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
            self._new.append(Pin(session, name, newest))
        return got

    def pinned(self, session: str, name: str) -> int | None:
        """The version ``session`` started on for ``name``, if it has one (no new pin)."""
        s = self._live(session, touch=False)
        return None if s is None else s.pins.get(name)

    def take_new_pins(self) -> list[Pin]:
        """The pins made here since the last call (for the control plane)."""
        new, self._new = self._new, []
        return new

    def adopt(self, pins: Iterable[Pin]) -> None:
        """Pins another copy made (the control plane's word): they win over none, and over a
        pin made here for the same session and name (the control plane keeps the first)."""
        for p in pins:
            self._get(p.session).pins[p.name] = p.version

    def forget(self, session: str) -> None:
        """``finish_session``: its replica and its versions are forgotten."""
        self._by_id.pop(session, None)
