"""The router made the flip durable but its answer never reached the Publisher.

A proxy in front of the real router forwards the alias PUT, lets the router apply it, then drops
the connection instead of answering: the Publisher must ask the router, find v serving, and
finish the publication, not unload the version the router now points at.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import ClientSession, web

from lorafleet.launch import bind_listener
from lorafleet.publisher import Publisher
from lorafleet.testing import greedy_completion, make_peft_adapter


def _proxy(
    sock: socket.socket, target: str, drop: threading.Event, dropped: list, stop: threading.Event
):
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        async with (
            ClientSession() as s,
            s.request(request.method, target + request.path_qs, headers=headers, data=body) as r,
        ):
            data = await r.read()
            status, ctype = r.status, r.headers.get("Content-Type", "application/json")
        if (
            drop.is_set()
            and request.method == "PUT"
            and request.path.startswith("/v1/control/aliases/")
        ):
            drop.clear()
            dropped.append(status)
            request.transport.close()  # the router applied it; the answer is lost
            return web.Response(status=status)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(main())


def test_lost_answer_to_the_flip_is_resolved_by_asking_the_router(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=71)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=8, seed=72)
    sock = bind_listener()
    port = sock.getsockname()[1]
    drop, stop, dropped = threading.Event(), threading.Event(), []
    t = threading.Thread(
        target=_proxy, args=(sock, fleet.router.url, drop, dropped, stop), daemon=True
    )
    t.start()
    try:
        with Publisher(
            fleet.agent_urls, router=f"http://127.0.0.1:{port}", token=fleet.token
        ) as pub:
            pub.publish(str(a), name="policy")
            drop.set()
            res = pub.publish(str(b), name="policy")
    finally:
        stop.set()
        t.join(5)
    assert dropped == [200]  # the flip was applied, and its answer dropped
    assert res.version == 2 and res.retired_versions == [1]
    status, _, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200 and body["lorafleet"]["version"] == 2
    for i in range(2):
        assert {(x["version"], x["state"]) for x in fleet.adapters(i)} == {(2, "active")}
