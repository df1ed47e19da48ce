"""Version-consistency checking: a bounded load generator and a pure checker.

``generate_load`` sends requests for one alias at a steady rate (about 50 req/s by default) for a
fixed duration and records, per request, when it was sent, when the headers came back, the
status, the version tag and every engine-side model name seen in the body. ``check`` replays
those observations against the router's alias log and reports each violation:

- ``failed``: the request did not succeed;
- ``untagged``: a success without a version tag (or tagged for another alias);
- ``wrong_version``: the tag's version was neither active when the request was sent nor activated
  while it waited for its first byte (the router resolves somewhere in between);
- ``mixed_versions``: the response shows two versions, e.g. the tag says v3 but the engine
  answered as ``policy@v4``, or two chunks of a stream name different versions.

Both share one clock (``time.time()`` on one machine), so no slack is needed; ``slack_s`` lets a
caller across machines allow the previous version for that long after each flip.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from lorafleet.protocol.router import TAG_FIELD, AliasEvent

__all__ = ["Observation", "Violation", "check", "generate_load", "implied_version"]

# vLLM answers with the adapter's engine name, SGLang with ``<base>:<engine name>``.
_ENGINE_NAME = re.compile(r"(?:.*:)?(?P<name>[^:]+)@v(?P<version>\d+)")


@dataclass
class Observation:
    """One request as the client saw it."""

    index: int
    t_send: float
    t_first: float | None = None
    t_done: float | None = None
    status: int = 0
    adapter: str | None = None
    version: int | None = None
    replica: str | None = None
    engine_models: list[str] = field(default_factory=list)
    """Engine-side model names seen: the tag's ``engine_model`` and any ``model`` field in the
    body that is not the alias itself (the router rewrites the engine name to the alias)."""
    error: str | None = None


@dataclass(frozen=True)
class Violation:
    kind: str
    index: int
    detail: str


def implied_version(engine_model: str, name: str) -> int | None:
    """The version an engine-side name like ``policy@v3`` or ``tiny:policy@v3`` stands for
    (None if not versioned)."""
    m = _ENGINE_NAME.fullmatch(engine_model)
    if m is None or m["name"] != name:
        return None
    return int(m["version"])


def _active_at(events: Sequence[AliasEvent], t: float) -> tuple[int | None, float | None]:
    """(version active at ``t``, when it became active)."""
    version, since = None, None
    for ev in events:
        if ev.ts > t:
            break
        version, since = ev.version, ev.ts
    return version, since


def check(
    observations: Iterable[Observation],
    log: Iterable[AliasEvent],
    name: str,
    *,
    slack_s: float = 0.0,
) -> list[Violation]:
    """Every violation in ``observations`` given the alias ``log`` for ``name``. Pure."""
    events = sorted((e for e in log if e.name == name), key=lambda e: e.seq)
    out: list[Violation] = []
    for o in observations:
        if o.status != 200 or o.error is not None:
            out.append(Violation("failed", o.index, f"status {o.status}: {o.error or ''}".strip()))
            continue
        if o.version is None or o.adapter != name:
            out.append(
                Violation("untagged", o.index, f"tag adapter={o.adapter!r} version={o.version}")
            )
            continue
        implied = {implied_version(m, name) for m in o.engine_models} - {None}
        if implied - {o.version}:
            out.append(
                Violation(
                    "mixed_versions",
                    o.index,
                    f"tagged v{o.version} but the engine answered as {sorted(o.engine_models)}",
                )
            )
        active, since = _active_at(events, o.t_send)
        until = o.t_first if o.t_first is not None else (o.t_done or o.t_send)
        allowed = {active} | {e.version for e in events if o.t_send < e.ts <= until}
        if slack_s and since is not None and o.t_send - since <= slack_s:
            before = [e.version for e in events if e.ts < since]
            if before:
                allowed.add(before[-1])
        if o.version not in allowed:
            out.append(
                Violation(
                    "wrong_version",
                    o.index,
                    f"served by v{o.version}; allowed {sorted(v for v in allowed if v)}"
                    f" (v{active} active at send)",
                )
            )
    return out


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    headers: dict[str, str],
    obs: Observation,
    name: str,
    stream: bool,
) -> None:
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            obs.t_first = time.time()
            obs.status = resp.status
            if stream and resp.status == 200:
                docs = []
                async for line in resp.content:
                    line = line.strip()
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        docs.append(json.loads(line[6:]))
            else:
                raw = await resp.read()
                docs = [json.loads(raw)] if raw else []
            obs.t_done = time.time()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        obs.t_done = time.time()
        obs.error = f"{type(exc).__name__}: {exc}"
        return
    if obs.status != 200:
        obs.error = json.dumps(docs[0])[:300] if docs else "no body"
        return
    for doc in docs:
        model = doc.get("model")
        if isinstance(model, str) and model != name:
            obs.engine_models.append(model)
        tag = doc.get(TAG_FIELD)
        if isinstance(tag, dict):
            obs.adapter, obs.version, obs.replica = (
                tag.get("adapter"),
                tag.get("version"),
                tag.get("replica"),
            )
            if tag.get("engine_model"):
                obs.engine_models.append(tag["engine_model"])


async def generate_load(
    router_url: str,
    name: str,
    *,
    rate: float = 50.0,
    duration_s: float = 5.0,
    stream: bool = False,
    api_key: str | None = None,
    max_tokens: int = 2,
    prompt: str = "hello",
    max_inflight: int = 64,
    timeout_s: float = 60.0,
    stop: threading.Event | None = None,
) -> list[Observation]:
    """Send ``rate * duration_s`` completions for ``name`` at a steady pace; one Observation each.

    ``stop``: end early (no new requests; those in flight complete) once this event is set.

    Requests start on schedule (not after the previous one finishes) but never more than
    ``max_inflight`` at once, so a slow router shows up as late starts rather than a pile-up.
    """
    n = max(1, int(rate * duration_s))
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body["stream"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = router_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_inflight)
    out: list[Observation] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def run(i: int) -> None:
            async with sem:
                obs = Observation(index=i, t_send=time.time())
                out.append(obs)
                await _one(session, url, body, headers, obs, name, stream)

        t0 = time.monotonic()
        tasks = []
        for i in range(n):
            if stop is not None and stop.is_set():
                break
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
    out.sort(key=lambda o: o.index)
    return out
