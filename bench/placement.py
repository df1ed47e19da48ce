"""Many adapters on few slots: lorafleet's placement against the resolver behind a round-robin.

Measured (real processes on loopback, reference engines on the tiny model):

- **lorafleet**: 4 replicas with 2, 3, 3 and 4 adapter slots (12 in all), 200 adapter names
  published with ``max_replicas=1`` (each evicting the least recently used version where its
  replica is full), then a Zipf(1.1) mix of requests over the 200 names, sent ``--concurrency``
  at a time through the router. A request for a cold name loads it on demand (docs/placement.md).
- **baseline**: what a user gets from vLLM's LoRA resolver behind an ordinary balancer: the same
  engines and request sequence, each request to the next engine in turn, which loads the adapter
  by name on first use and evicts its least recently used one when full (client-side, through
  the engines' own load and unload routes).
- **limit**: the same requests with every adapter already loaded (one per engine, round-robin
  straight to the engines): the machine's own ceiling, in the same run.

It prints throughput, the slot hit rate, and cold-start p50/p99 (lorafleet: the router's
``lorafleet_router_cold_start_seconds``; baseline: the engine load it waited for), each beside
the limit as a ratio.

Then a **simulation** (``--sim-only`` runs just this) of 64 replicas with 4 slots each and
10,000 adapters, from the measured hit service time and load time: a discrete-event model of both
policies under a Zipf(1.1) Poisson stream at 70% of the all-hit capacity.

Usage: python bench/placement.py [--requests 1000] [--concurrency 8] [--names 200]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import secrets
import statistics
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx

from _limits import make_adapters
from lorafleet.launch import Launcher
from lorafleet.protocol.placement import rendezvous
from lorafleet.publisher import Publisher
from lorafleet.testing import start_agent, start_reference_engine, start_router
from lorafleet.tinymodel import ensure_tiny_model

SLOTS = [2, 3, 3, 4]
PROMPT = "The capital of"


def zipf_mix(names: list[str], n: int, s: float = 1.1, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** s for k in range(len(names))]
    return rng.choices(names, weights=weights, k=n)


def q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


async def drive(send, mix: list[str], concurrency: int) -> tuple[float, list[float], int]:
    """Send ``mix`` ``concurrency`` at a time; (wall seconds, latencies, failures)."""
    it = iter(enumerate(mix))
    lat: list[float] = []
    failed = 0

    async def worker() -> None:
        nonlocal failed
        for _, name in it:
            t = time.perf_counter()
            ok = await send(name)
            lat.append(time.perf_counter() - t)
            failed += not ok

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat, failed


def histogram_quantile(text: str, metric: str, p: float) -> float:
    """Prometheus' histogram_quantile over one unlabelled histogram in ``text``."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(metric + "_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    rank = p * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-9)
        prev_le, prev_c = le, c
    return prev_le


def metric(text: str, key: str) -> float:
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(key))


# --- measured --------------------------------------------------------------------------------


async def run_lorafleet(model, adapters, mix, concurrency, root) -> dict:
    token = secrets.token_urlsafe(12)
    with Launcher(root / "lf-logs") as launcher:
        engines = [start_reference_engine(launcher, model, max_loras=s, max_lora_rank=16)
                   for s in SLOTS]  # fmt: skip
        agents = [start_agent(launcher, e, root / f"lf-agent{i}", token=token, max_lora_rank=16)
                  for i, e in enumerate(engines)]  # fmt: skip
        router = start_router(launcher, agents, root / "lf-router", token=token,
                              health_interval=0.5, extra=("--grow-at", "4"))  # fmt: skip
        names = [f"a{i:03d}" for i in range(len(adapters))]
        t = time.perf_counter()
        with Publisher([a.url for a in agents], router=router.url, token=token) as pub:
            for name, src in zip(names, adapters, strict=True):
                pub.publish(str(src), name=name, max_replicas=1)
        publish_s = time.perf_counter() - t
        async with httpx.AsyncClient(timeout=300) as http:

            async def send(name: str) -> bool:
                r = await http.post(router.url + "/v1/completions", json=body(name))
                ok = r.status_code == 200 and r.json()["lorafleet"]["adapter"] == name
                if not ok and len(errors) < 5:
                    errors.append(f"{name}: {r.status_code} {r.text[:300]}")
                return ok

            errors: list[str] = []

            wall, lat, failed = await drive(send, mix, concurrency)
            text = (await http.get(router.url + "/metrics")).text
        for e in errors:
            print("lorafleet failure:", e)
        loads = metric(text, 'lorafleet_router_on_demand_loads_total{outcome="ok"')
        return {
            "publish_s": publish_s,
            "wall": wall,
            "lat": lat,
            "failed": failed,
            "loads": loads,
            "evictions": metric(text, "lorafleet_router_evictions_total"),
            "cold_p50": histogram_quantile(text, "lorafleet_router_cold_start_seconds", 0.5),
            "cold_p99": histogram_quantile(text, "lorafleet_router_cold_start_seconds", 0.99),
        }


async def run_baseline(model, adapters, mix, concurrency, root) -> dict:
    with Launcher(root / "bl-logs") as launcher:
        engines = [start_reference_engine(launcher, model, max_loras=s, max_lora_rank=16)
                   for s in SLOTS]  # fmt: skip
        src = {f"a{i:03d}": str(p) for i, p in enumerate(adapters)}
        cache = [OrderedDict() for _ in engines]  # per engine: name -> None, LRU first
        locks = [asyncio.Lock() for _ in engines]
        inflight = [dict() for _ in engines]
        loads: list[float] = []
        rr = 0
        async with httpx.AsyncClient(timeout=300) as http:

            async def ensure(i: int, name: str) -> None:
                """Loaded on engine ``i`` and counted in flight there (under the lock: the
                resolver never evicts an adapter of its running batch)."""
                e = engines[i]
                async with locks[i]:
                    if name in cache[i]:
                        cache[i].move_to_end(name)
                        inflight[i][name] = inflight[i].get(name, 0) + 1
                        return
                    t = time.perf_counter()
                    while len(cache[i]) >= SLOTS[i]:
                        # The resolver's LRU: the least recently used one not serving right now.
                        victim = next((n for n in cache[i] if not inflight[i].get(n)), None)
                        if victim is None:
                            await asyncio.sleep(0.005)
                            continue
                        del cache[i][victim]
                        await http.post(e.url + "/v1/unload_lora_adapter",
                                        json={"lora_name": victim})  # fmt: skip
                    load = {"lora_name": name, "lora_path": src[name]}
                    r = await http.post(e.url + "/v1/load_lora_adapter", json=load)
                    r.raise_for_status()
                    cache[i][name] = None
                    inflight[i][name] = inflight[i].get(name, 0) + 1
                    loads.append(time.perf_counter() - t)

            async def send(name: str) -> bool:
                nonlocal rr
                i = rr = (rr + 1) % len(engines)
                await ensure(i, name)
                try:
                    r = await http.post(engines[i].url + "/v1/completions", json=body(name))
                    return r.status_code == 200
                finally:
                    inflight[i][name] -= 1

            wall, lat, failed = await drive(send, mix, concurrency)
        return {"wall": wall, "lat": lat, "failed": failed, "loads": len(loads),
                "cold_p50": q(loads, 0.5), "cold_p99": q(loads, 0.99)}  # fmt: skip


async def run_limit(model, adapters, mix, concurrency, root) -> dict:
    with Launcher(root / "lim-logs") as launcher:
        engines = [start_reference_engine(launcher, model, max_loras=s, max_lora_rank=16)
                   for s in SLOTS]  # fmt: skip
        async with httpx.AsyncClient(timeout=300) as http:
            for i, e in enumerate(engines):
                load = {"lora_name": "hot", "lora_path": str(adapters[i])}
                r = await http.post(e.url + "/v1/load_lora_adapter", json=load)
                r.raise_for_status()
            rr = 0

            async def send(_name: str) -> bool:
                nonlocal rr
                i = rr = (rr + 1) % len(engines)
                r = await http.post(engines[i].url + "/v1/completions", json=body("hot"))
                return r.status_code == 200

            wall, lat, failed = await drive(send, mix, concurrency)
        return {"wall": wall, "lat": lat, "failed": failed}


# --- simulated -------------------------------------------------------------------------------


def simulate(policy: str, replicas: int, slots: int, names: int, n: int, service_s: float,
             load_s: float, clients_per_replica: int = 4, grow_at: int = 4,
             seed: int = 5) -> dict:  # fmt: skip
    """A discrete-event model, closed loop: ``clients_per_replica`` x ``replicas`` clients each
    send their next request when the last one is answered, for an adapter drawn Zipf(1.1) over
    ``names``; one FIFO server per replica, ``service_s`` per request, ``load_s`` more on the
    replica that loads a version it lacks (evicting its least recently used one).

    ``lorafleet``: the least loaded replica holding the name; none: the name's rendezvous-first
    replica loads it; a holder with ``grow_at`` of the name's requests in flight: the name's
    next-ranked replica loads it too (``--grow-at``). ``resolver``: the next replica in turn,
    which loads what it lacks (vLLM's resolver behind a round-robin balancer)."""
    rng = random.Random(seed)
    ids = [str(i) for i in range(replicas)]
    cum = list(_accumulate(1 / (k + 1) ** 1.1 for k in range(names)))
    free_at = [0.0] * replicas
    held = [OrderedDict() for _ in range(replicas)]
    where: dict[int, set[int]] = {}
    out: dict[tuple[int, int], int] = {}
    ranks: dict[int, list[int]] = {}
    lat: list[float] = []
    loads = 0
    rr = 0

    def ranked(k: int) -> list[int]:
        got = ranks.get(k)
        if got is None:
            got = ranks[k] = [int(x) for x in rendezvous(str(k), ids)]
        return got

    def load(i: int, k: int, now: float) -> None:
        nonlocal loads
        loads += 1
        if len(held[i]) >= slots:
            old, _ = held[i].popitem(last=False)
            where[old].discard(i)
        held[i][k] = None
        where.setdefault(k, set()).add(i)
        free_at[i] = max(now, free_at[i]) + load_s

    def send(now: float) -> tuple[float, int, int, float]:
        nonlocal rr
        k = _pick(cum, rng.random() * cum[-1])
        if policy == "lorafleet":
            if not where.get(k):
                load(ranked(k)[0], k, now)
            holders = where[k]
            i = min(holders, key=lambda j: free_at[j])
            if out.get((i, k), 0) >= grow_at and len(holders) < replicas:
                load(next(x for x in ranked(k) if x not in holders), k, now)
                i = min(where[k], key=lambda j: free_at[j])
        else:
            i = rr = (rr + 1) % replicas
            if k not in held[i]:
                load(i, k, now)
        held[i].move_to_end(k)
        out[(i, k)] = out.get((i, k), 0) + 1
        free_at[i] = max(now, free_at[i]) + service_s
        return free_at[i], i, k, now

    events = [send(0.0) for _ in range(clients_per_replica * replicas)]
    heapq.heapify(events)
    done = 0
    t = 0.0
    while done < n:
        t, i, k, sent = heapq.heappop(events)
        out[(i, k)] -= 1
        lat.append(t - sent)
        done += 1
        heapq.heappush(events, send(t))
    return {"hit": 1 - loads / n, "p50": q(lat, 0.5), "p99": q(lat, 0.99),
            "throughput": n / t}  # fmt: skip


def _accumulate(ws):
    s = 0.0
    for w in ws:
        s += w
        yield s


def _pick(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--names", type=int, default=200)
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--service-ms", type=float, default=None, help="(--sim-only) hit service time")
    ap.add_argument("--load-ms", type=float, default=None, help="(--sim-only) load time")
    args = ap.parse_args()

    service_s = (args.service_ms or 35.0) / 1e3
    load_s = {"lorafleet": (args.load_ms or 400.0) / 1e3, "resolver": (args.load_ms or 82.0) / 1e3}
    if not args.sim_only:
        model = ensure_tiny_model()
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            adapters = make_adapters(model, root / "adapters", args.names, rank=8)
            mix = zipf_mix([f"a{i:03d}" for i in range(args.names)], args.requests)
            limit = asyncio.run(run_limit(model, adapters, mix, args.concurrency, root))
            lf = asyncio.run(run_lorafleet(model, adapters, mix, args.concurrency, root))
            bl = asyncio.run(run_baseline(model, adapters, mix, args.concurrency, root))
        lim_tp = args.requests / limit["wall"]
        print(f"limit (every adapter hot, straight to the engines): {lim_tp:.1f} req/s, "
              f"p50 {q(limit['lat'], .5) * 1e3:.1f} ms")  # fmt: skip
        print(f"lorafleet: {args.names} names published in {lf['publish_s']:.1f} s")
        for label, r in (("lorafleet", lf), ("baseline (resolver, round-robin)", bl)):
            tp = args.requests / r["wall"]
            hit = 1 - r["loads"] / args.requests
            print(
                f"{label}: {tp:.1f} req/s = {tp / lim_tp:.2f}x the limit; slot hit rate "
                f"{hit:.3f}; request p50 {q(r['lat'], 0.5) * 1e3:.1f} ms, p99 "
                f"{q(r['lat'], 0.99) * 1e3:.1f} ms; cold start p50 {r['cold_p50'] * 1e3:.0f} ms, "
                f"p99 {r['cold_p99'] * 1e3:.0f} ms; failed {r['failed']}"
            )
        service_s = statistics.median(limit["lat"]) / max(1, args.concurrency / len(SLOTS))
        load_s = {"lorafleet": lf["cold_p50"], "resolver": bl["cold_p50"]}
        print(f"measured for the simulation: hit service {service_s * 1e3:.1f} ms per request per "
              f"replica; a load: lorafleet's cold start {load_s['lorafleet'] * 1e3:.0f} ms (evict, "
              f"drain, load, prove, list), the resolver's {load_s['resolver'] * 1e3:.0f} ms "
              "(unload, load)")  # fmt: skip
    for policy in ("lorafleet", "resolver"):
        s = simulate(policy, 64, 4, 10_000, 200_000, service_s, load_s[policy])
        cap = 64 / service_s
        print(
            f"simulated 64 replicas x 4 slots, 10,000 adapters, {policy}: "
            f"{s['throughput']:.0f} req/s = {s['throughput'] / cap:.2f}x the all-hit capacity "
            f"({cap:.0f}); slot hit rate {s['hit']:.3f}; p50 {s['p50'] * 1e3:.0f} ms, p99 "
            f"{s['p99'] * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
