"""The stream tag goes in at the real end-of-stream event, whatever the engine's bytes look like.

A model's text can contain ``data: [DONE]``, and an engine may flush an event in pieces of any
size. A real engine cannot be made to produce either on demand, so a canned SSE engine (behind a
canned agent) drives the real router process here.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from aiohttp import web

from lorafleet.launch import bind_listener
from lorafleet.testing import start_router
from tests.router.helpers import wait_healthy

TEXT = 'say data: [DONE] now\\n\\ndata: [DONE] \\"quoted\\"'
EVENT = (
    'data: {"id":"c1","object":"text_completion","model":"tiny","choices":[{"index":0,'
    f'"text":"{TEXT}","finish_reason":null}}]}}\n\n'
)


def _serve(
    engine_sock: socket.socket, agent_sock: socket.socket, piece: int, stop: threading.Event
) -> None:
    port = engine_sock.getsockname()[1]

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = (EVENT * 2 + "data: [DONE]\n\n").encode()
        for i in range(0, len(data), piece):
            await resp.write(data[i : i + piece])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "engine_reachable": True, "reconciling": False})

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "replica_id": "canned",
                "engine_url": f"http://127.0.0.1:{port}",
                "base_model": "tiny",
                "capabilities": {"kind": "vllm"},
                "ready": True,
            }
        )

    async def main() -> None:
        engine, agent = web.Application(), web.Application()
        engine.router.add_post("/v1/completions", completions)
        agent.router.add_get("/v1/info", info)
        agent.router.add_get("/health", health)
        runners = []
        for app, sock in ((engine, engine_sock), (agent, agent_sock)):
            r = web.AppRunner(app, access_log=None)
            await r.setup()
            await web.SockSite(r, sock).start()
            runners.append(r)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for r in runners:
            await r.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("piece", [1, 7, 64, 4096])
def test_tag_lands_before_the_real_done(launcher, piece):
    engine_sock, agent_sock = bind_listener(), bind_listener()
    agent_url = f"http://127.0.0.1:{agent_sock.getsockname()[1]}"
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(engine_sock, agent_sock, piece, stop), daemon=True)
    t.start()
    try:
        router = start_router(launcher, [agent_url], token="ctl", health_interval=0.2)
        wait_healthy(router, 1)
        with httpx.stream(
            "POST",
            router.url + "/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True},
        ) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
    finally:
        stop.set()
        t.join(5)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [p["choices"][0]["text"] for p in payloads if p["choices"]]
    assert texts == [json.loads(f'"{TEXT}"')] * 2  # the model's text is untouched
    tags = [p for p in payloads if "lorafleet" in p]
    assert len(tags) == 1 and tags[0] is payloads[-1]
    assert tags[0]["lorafleet"]["replica"] == "canned"
