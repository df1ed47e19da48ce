"""Router overhead: lorafleet's data plane vs the Rust routers, same run, same backend.

Starts a canned-answer OpenAI backend and a stub agent (so lorafleet can discover the replica)
in this process, then measures ``/v1/completions`` directly (the machine's own limit for this
backend), through ``vllm-router`` and SGLang's ``sglang-router`` (both Rust), through the
``lorafleet router`` process (base-model routing, bytes passed through; and alias routing,
``model=policy`` resolved to ``policy@v1``, the engine name spliced in, the answer tagged), and
through ``lorafleet dataplane`` copies of that router (``--workers`` 1, 2, 4 on one socket),
alternating, at each concurrency. Load comes from ``wrk`` when it is on PATH (a C load generator:
it leaves the cores to what is measured), else from aiohttp in this process.

    .venv/bin/python bench/router_overhead.py [--n 2000] [--c 1,16,128] [--rounds 2] \
        [--copies 1,2,4] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held together while chosen, so none comes back twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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


_WRK_LUA = """
wrk.method = "POST"
wrk.body = '{"model": "%s", "prompt": "hi", "max_tokens": 1}'
wrk.headers["Content-Type"] = "application/json"
"""


def _ms(text: str) -> float:
    """wrk's ``12.34ms`` / ``850.00us`` / ``1.02s`` in milliseconds."""
    value, unit = re.fullmatch(r"([\d.]+)([a-z]+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def wrk_load(url: str, c: int, model: str, seconds: float) -> tuple[float, float, float]:
    """(p50 s, p99 s, requests/s) of ``c`` connections for ``seconds``, measured by wrk."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_LUA % model)
    argv = ["wrk", f"-t{min(2, c)}", f"-c{c}", f"-d{max(1, round(seconds))}s", "--latency"]
    argv += ["-s", f.name, url + "/v1/completions"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    lat = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("50%", "99%"):
            lat[parts[0]] = _ms(parts[1]) / 1e3
        if line.startswith("Requests/sec:"):
            rps = float(line.split()[1])
        if "Non-2xx" in line or "Socket errors" in line:
            raise SystemExit(f"{url}: {line.strip()}")
    return lat["50%"], lat["99%"], rps


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


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="requests per measure (aiohttp load)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per measure (wrk load)")
    ap.add_argument("--c", default="1,16,128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--copies", default="1,2,4", help="workers of lorafleet dataplane to measure")
    a = ap.parse_args()
    use_wrk = shutil.which("wrk") is not None
    copies = [int(x) for x in a.copies.split(",") if x]
    bport, aport, vport, sport, lport, vprom, sprom, *cports = free_ports(7 + len(copies))
    runners = await start_backend(bport, aport)
    backend = f"http://127.0.0.1:{bport}"
    procs = [
        # Each Rust router exports Prometheus metrics on port 29000 by default: one each.
        spawn([venv_bin("vllm-router"), "--host", "127.0.0.1", "--port", str(vport),
               "--worker-urls", backend, "--policy", "round_robin",
               "--prometheus-port", str(vprom)]),
        spawn([sys.executable, "-m", "lorafleet", "router", "--agents",
               f"http://127.0.0.1:{aport}", "--port", str(lport), "--control-token", "bench",
               "--health-interval", "2"]),
    ]  # fmt: skip
    targets = [("direct", backend, "tiny"), ("vllm-router", f"http://127.0.0.1:{vport}", "tiny")]
    if shutil.which(venv_bin("sglang-router")):
        procs.append(
            spawn([venv_bin("sglang-router"), "launch", "--host", "127.0.0.1", "--port",
                   str(sport), "--worker-urls", backend, "--policy", "round_robin",
                   "--disable-health-check", "--log-level", "error",
                   "--prometheus-port", str(sprom)])
        )  # fmt: skip
        targets.append(("sglang-router", f"http://127.0.0.1:{sport}", "tiny"))
    lr = f"http://127.0.0.1:{lport}"
    targets += [("lorafleet base", lr, "tiny"), ("lorafleet alias", lr, "policy")]
    for workers, port in zip(copies, cports, strict=True):
        procs.append(
            spawn([sys.executable, "-m", "lorafleet", "dataplane", "--control", lr,
                   "--control-token", "bench", "--port", str(port), "--workers", str(workers),
                   "--health-interval", "2"])
        )  # fmt: skip
        targets.append((f"lorafleet {workers} cop{'y' if workers == 1 else 'ies'}",
                        f"http://127.0.0.1:{port}", "policy"))  # fmt: skip
    try:
        for _, url, model in targets[:2]:
            await wait_up(url, model)
        await wait_up(lr, "tiny")
        async with aiohttp.ClientSession() as s:
            body = {"version": 1, "engine_name": "policy@v1", "replicas": ["r0"]}
            hdr = {"Authorization": "Bearer bench"}
            async with s.put(lr + "/v1/control/aliases/policy", json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
        for name, url, model in targets:
            try:
                await wait_up(url, model, secs=60)
            except SystemExit:
                raise SystemExit(f"{name} ({url}) never answered") from None
        loader = "wrk" if use_wrk else "aiohttp in this process"
        cores = os.cpu_count()
        print(f"load: {loader}; {cores} cores share the load, the backend and what is measured")

        async def measure(url: str, c: int, model: str) -> tuple[float, float, float]:
            if use_wrk:
                return await asyncio.to_thread(wrk_load, url, c, model, a.seconds)
            return await load(url, a.n, c, model)

        for c in [int(x) for x in a.c.split(",")]:
            for _, url, model in targets:
                await (asyncio.to_thread(wrk_load, url, c, model, 1.0) if use_wrk
                       else load(url, 200, c, model))  # warm  # fmt: skip
            res: dict[str, list] = {t[0]: [] for t in targets}
            for _ in range(a.rounds):
                for name, url, model in targets:
                    res[name].append(await measure(url, c, model))
            med = {
                k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in res.items()
            }
            d = med["direct"]
            print(f"c={c}: direct p50 {d[0] * 1e3:.2f} ms p99 {d[1] * 1e3:.2f} ms {d[2]:.0f} req/s")
            for name, _, _ in targets[1:]:
                m = med[name]
                print(
                    f"  {name:18s} p50 {m[0] * 1e3:.2f} ms p99 {m[1] * 1e3:.2f} ms {m[2]:.0f} req/s"
                    f" | added p50 {(m[0] - d[0]) * 1e3:+.2f} ms p99 {(m[1] - d[1]) * 1e3:+.2f} ms,"
                    f" throughput ratio {m[2] / d[2]:.2f}"
                )
            sys.stdout.flush()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            p.wait()
        for r in runners:
            await r.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
