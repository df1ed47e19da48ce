"""Router overhead (issue 7): lorafleet router vs the Rust ``vllm-router``, same run and backend.

Starts a canned-answer OpenAI backend and a stub agent (so the lorafleet router can discover the
replica) in this process, then measures ``/v1/completions`` directly, through ``vllm-router`` and
through ``lorafleet router``, alternating, at each concurrency. The lorafleet router is measured
twice: base-model routing (bytes passed through) and alias routing (``model=policy`` resolved to
``policy@v1``, body rewritten, response tagged). Based on the project's router-overhead anchor.

    .venv/bin/python bench/router_overhead.py [--n 2000] [--c 1,16,128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

CANNED = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_backend(port: int, agent_port: int) -> list[web.AppRunner]:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(CANNED)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "replica_id": "r0",
                "engine_url": f"http://127.0.0.1:{port}",
                "base_model": "tiny",
                "capabilities": {"kind": "reference"},
                "ready": True,
            }
        )

    runners = []
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    agent = web.Application()
    agent.router.add_get("/v1/info", info)
    agent.router.add_get("/health", health)
    for a, p in ((app, port), (agent, agent_port)):
        r = web.AppRunner(a, access_log=None)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", p).start()
        runners.append(r)
    return runners


async def load(url: str, n: int, c: int, model: str) -> tuple[float, float, float]:
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=c)
    async with aiohttp.ClientSession(connector=conn) as s:
        sem = asyncio.Semaphore(c)

        async def one() -> None:
            async with sem:
                t = time.perf_counter()
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        wall = time.perf_counter() - t0
    lat.sort()
    return lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1], n / wall


async def wait_up(url: str, model: str, secs: float = 30) -> None:
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            try:
                body = {"model": model, "prompt": "x", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url} never answered")


def venv_bin(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--c", default="1,16,128")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    bport, aport, vport, lport = free_port(), free_port(), free_port(), free_port()
    runners = await start_backend(bport, aport)
    backend = f"http://127.0.0.1:{bport}"
    procs = [
        subprocess.Popen(
            [
                venv_bin("vllm-router"),
                "--host",
                "127.0.0.1",
                "--port",
                str(vport),
                "--worker-urls",
                backend,
                "--policy",
                "round_robin",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lorafleet",
                "router",
                "--agents",
                f"http://127.0.0.1:{aport}",
                "--port",
                str(lport),
                "--control-token",
                "bench",
                "--health-interval",
                "2",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ),
    ]
    try:
        vr, lr = f"http://127.0.0.1:{vport}", f"http://127.0.0.1:{lport}"
        await wait_up(vr, "tiny")
        await wait_up(lr, "tiny")
        async with aiohttp.ClientSession() as s:
            body = {"version": 1, "engine_name": "policy@v1", "replicas": ["r0"]}
            hdr = {"Authorization": "Bearer bench"}
            async with s.put(lr + "/v1/control/aliases/policy", json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
        targets = [
            ("direct", backend, "tiny"),
            ("vllm-router", vr, "tiny"),
            ("lorafleet base", lr, "tiny"),
            ("lorafleet alias", lr, "policy"),
        ]
        for c in [int(x) for x in a.c.split(",")]:
            for _, url, model in targets:
                await load(url, 200, c, model)  # warm
            res: dict[str, list] = {t[0]: [] for t in targets}
            for _ in range(a.rounds):
                for name, url, model in targets:
                    res[name].append(await load(url, a.n, c, model))
            med = {
                k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in res.items()
            }
            d = med["direct"]
            print(f"c={c}: direct p50 {d[0] * 1e3:.2f} ms p99 {d[1] * 1e3:.2f} ms {d[2]:.0f} req/s")
            for name, _, _ in targets[1:]:
                m = med[name]
                print(
                    f"  {name:16s} p50 {m[0] * 1e3:.2f} ms p99 {m[1] * 1e3:.2f} ms {m[2]:.0f} req/s"
                    f" | added p50 {(m[0] - d[0]) * 1e3:+.2f} ms p99 {(m[1] - d[1]) * 1e3:+.2f} ms,"
                    f" throughput ratio {m[2] / d[2]:.2f}"
                )
            sys.stdout.flush()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()
        for r in runners:
            await r.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
