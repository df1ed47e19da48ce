"""The router's answer to the alias flip never reached the Publisher.

A proxy in front of the real router loses the answer to the alias PUT. When the router did apply
the flip, the Publisher must ask the router, find v serving, and finish the publication, not
unload the version the router now points at. When it did not, the publication rolls back. When
the router's table cannot be read either, v stays loaded everywhere and the error says so.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import ClientSession, web

from lorafleet.errors import PublishError
from lorafleet.launch import bind_listener
from lorafleet.publisher import Publisher
from lorafleet.publisher._transaction import FLIP_PROBE_ATTEMPTS
from lorafleet.testing import greedy_completion, make_peft_adapter


class _LossyProxy:
    """Forwards everything to the router. Once armed, the next alias PUT loses its answer (its
    status goes to ``dropped``), as ``mode`` says: ``"applied"`` forwards it, then drops the
    connection; ``"unsent"`` answers 502 without forwarding it; ``"unreadable"`` is ``"applied"``
    and then answers every table read with 503 (counted in ``reads``)."""

    def __init__(self, target: str, mode: str = "applied") -> None:
        self.target, self.mode = target, mode
        self.sock = bind_listener()  # bound now: no port race with other tests
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.armed, self.ready, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.dropped: list[int] = []
        self.reads = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def __enter__(self) -> _LossyProxy:
        self._thread.start()
        assert self.ready.wait(30), "the proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(5)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        is_flip = request.method == "PUT" and request.path.startswith("/v1/control/aliases/")
        if self.armed.is_set() and is_flip and self.mode == "unsent":
            self.armed.clear()
            self.dropped.append(502)
            return web.Response(status=502, text="bad gateway")
        is_read = request.method == "GET" and request.path == "/v1/control/aliases"
        if self.mode == "unreadable" and self.dropped and is_read:
            self.reads += 1
            return web.Response(status=503, text="unavailable")
        body = await request.read()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        async with (
            ClientSession() as s,
            s.request(
                request.method, self.target + request.path_qs, headers=headers, data=body
            ) as r,
        ):
            data = await r.read()
            status, ctype = r.status, r.headers.get("Content-Type", "application/json")
        if self.armed.is_set() and is_flip:
            self.armed.clear()
            self.dropped.append(status)
            request.transport.close()  # the router applied it; the answer is lost
            return web.Response(status=status)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, self.sock).start()
        self.ready.set()
        while not self.stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()


def test_lost_answer_to_the_flip_is_resolved_by_asking_the_router(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=71)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=8, seed=72)
    with (
        _LossyProxy(fleet.router.url) as proxy,
        Publisher(
            fleet.agent_urls, router=proxy.url, token=fleet.token, retire_in_background=False
        ) as pub,
    ):
        pub.publish(str(a), name="policy")
        proxy.armed.set()
        res = pub.publish(str(b), name="policy")
    assert proxy.dropped == [200]  # the flip was applied, and its answer dropped
    assert res.version == 2 and res.retired_versions == [1]
    status, _, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200 and body["lorafleet"]["version"] == 2
    for i in range(2):
        assert {(x["version"], x["state"]) for x in fleet.adapters(i)} == {(2, "active")}


def test_lost_flip_that_never_reached_the_router_rolls_back(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=73)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=8, seed=74)
    with (
        _LossyProxy(fleet.router.url, "unsent") as proxy,
        Publisher(fleet.agent_urls, router=proxy.url, token=fleet.token) as pub,
    ):
        pub.publish(str(a), name="policy")
        proxy.armed.set()
        with pytest.raises(PublishError) as err:
            pub.publish(str(b), name="policy")
    assert proxy.dropped == [502]
    assert set(err.value.failures) == {"router"}
    assert "at the router's alias flip" in str(err.value) and "v1 keeps serving" in str(err.value)
    status, _, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200 and body["lorafleet"]["version"] == 1
    for i in range(2):
        assert {(x["version"], x["state"]) for x in fleet.adapters(i)} == {(1, "active")}
    assert fleet.staging_bytes() == [0, 0]


def test_lost_flip_with_an_unreadable_table_keeps_v_loaded(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=75)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=8, seed=76)
    with (
        _LossyProxy(fleet.router.url, "unreadable") as proxy,
        Publisher(fleet.agent_urls, router=proxy.url, token=fleet.token) as pub,
    ):
        pub.publish(str(a), name="policy")
        proxy.armed.set()
        with pytest.raises(PublishError, match="cannot be read; v2 stays loaded") as err:
            pub.publish(str(b), name="policy")
    assert proxy.dropped == [200] and proxy.reads == FLIP_PROBE_ATTEMPTS
    assert set(err.value.failures) == {"router"}
    # the router does point at v2, and every replica can serve it
    status, _, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200 and body["lorafleet"]["version"] == 2
    for i in range(2):
        assert {x["version"] for x in fleet.adapters(i)} == {1, 2}
    assert fleet.staging_bytes() == [0, 0]
    # with the router readable again, the next publication succeeds and cleans up
    with Publisher(
        fleet.agent_urls, router=fleet.router.url, token=fleet.token, retire_in_background=False
    ) as pub:
        res = pub.publish(str(a), name="policy")
    assert res.version == 3 and res.retired_versions == [1, 2]
    for i in range(2):
        assert {(x["version"], x["state"]) for x in fleet.adapters(i)} == {(3, "active")}
