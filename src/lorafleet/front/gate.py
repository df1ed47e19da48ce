"""Pause and continue for trainers that freeze their inference server around a weight update.

AReaL pauses every server before it loads a new adapter (SGLang's ``/pause_generation``, its
vLLM server's ``/areal_pause_generation``) and continues after. On those servers a pause in
``abort`` mode ends every request in flight, which answers at once with finish reason ``abort``,
and holds new requests until ``continue``; the trainer resends an aborted prompt (with what it
got) after the update. The front does the same for the generation that passes through it, and
only that: other trainers on the fleet are not paused. lorafleet's loads never need the pause
(a load is an atomic flip and every request is pinned to the version it started with), so a
pause costs only what the trainer asked for.

A request the router can abort by its ``rid`` (SGLang's native ``/generate``) is aborted there:
the router ends it on its engine and answers with what was generated, finish reason ``abort``,
so the trainer resends only the rest. Any other (OpenAI's routes) is cut off at the front and
answered with no output and finish reason ``abort``; the trainer resends the whole prompt.

``retract`` and ``in_place`` (SGLang's other modes) freeze requests on the real server and run
them on after ``continue``; the front cannot freeze a request on a shared engine, so in those
modes the requests in flight run to their end while new ones wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

__all__ = ["ABORT_GRACE_S", "Aborted", "GenerationGate", "PauseReport"]

T = TypeVar("T")
ABORT_GRACE_S = 10.0
"""How long a request the router was asked to abort may take to answer before it is cut off."""
Mode = Literal["abort", "retract", "in_place"]


class Aborted(Exception):
    """A generation in flight was ended by a pause in ``abort`` mode."""


@dataclass(frozen=True)
class PauseReport:
    """What a pause did: its mode, how many requests it aborted, how many it let finish."""

    mode: str
    aborted: int
    running: int

    def words(self) -> str:
        if self.mode == "abort":
            return (
                f"paused; {self.aborted} generation(s) in flight through this front aborted "
                "(answered with finish reason abort); new ones wait for continue"
            )
        return (
            f"paused ({self.mode}); {self.running} generation(s) in flight run to their end "
            "(a shared engine cannot freeze them); new ones wait for continue"
        )


class GenerationGate:
    """Holds new generation while paused; aborts the abortable ones in flight on request."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._inflight: dict[asyncio.Task, bool] = {}  # task -> abortable
        self._soft: dict[asyncio.Task, Callable[[], Awaitable[object]]] = {}
        self.aborted_total = 0
        """Generations this gate has aborted since the front started (tests read it)."""

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def inflight(self) -> int:
        """Generations running through the gate now (held ones not counted)."""
        return len(self._inflight)

    async def run(
        self,
        work: Callable[[], Awaitable[T]],
        *,
        abortable: bool = True,
        abort: Callable[[], Awaitable[object]] | None = None,
    ) -> T:
        """Run ``work`` once the gate is open. ``abort``: how to ask for it to end with its
        partial answer (``work`` then returns that); without it a pause cuts it off. Raises
        ``Aborted`` if a pause cut it off."""
        await self._open.wait()
        task = asyncio.ensure_future(work())
        self._inflight[task] = abortable
        if abort is not None:
            self._soft[task] = abort
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Either the client went away (cancel the work too) or a pause cancelled the task.
            if task.cancelled() and not _current_cancelling():
                raise Aborted() from None
            task.cancel()
            raise
        finally:
            self._inflight.pop(task, None)
            self._soft.pop(task, None)

    async def pause(self, mode: str = "abort") -> PauseReport:
        """Close the gate; in ``abort`` mode end what is in flight and wait until it has ended."""
        self._open.clear()
        if mode != "abort":
            return PauseReport(mode, 0, len(self._inflight))
        victims = [t for t, abortable in self._inflight.items() if abortable and not t.done()]
        soft = [t for t in victims if t in self._soft]
        for t in victims:
            if t not in soft:
                t.cancel()
        asked = await asyncio.gather(*(self._soft[t]() for t in soft), return_exceptions=True)
        for t, outcome in zip(soft, asked, strict=True):
            if isinstance(outcome, BaseException):
                t.cancel()  # the router could not be asked: cut it off instead
        if victims:
            _, late = await asyncio.wait(victims, timeout=ABORT_GRACE_S)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late)
        self.aborted_total += len(victims)
        return PauseReport(mode, len(victims), len(self._inflight) - len(victims))

    def resume(self) -> None:
        """Open the gate: the held requests go on."""
        self._open.set()


def _current_cancelling() -> bool:
    """Whether the running task itself is being cancelled (the client left), not its work."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
