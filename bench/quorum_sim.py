"""All-or-nothing against quorum publication on fleets of 16 to 4,096 replicas, by simulation.

A discrete-event model driven by two kinds of input, and the output says which is which:

**Measured here, in the same run** (unless ``--inputs-from`` reuses a recorded run): a small
local reference fleet (``--replicas``, default 4: a reference engine and an agent each, real
processes on loopback) publishes a real PEFT adapter (all-linear LoRA at ``--rank`` on the tiny
model; r=1024 is 16 MiB), new bytes every time, ``--runs`` times after one warm-up, interleaved:
through a router over agent 0 alone (one upload) and through one over all agents (the relay
chain), and a 60 KB adapter to agent 0 alone (the fixed cost of an upload session). From the
Publisher's own ``PublishResult`` timings, medians: the upload to one agent, the per-hop cost of
the relay chain h = (upload(n) - upload(1)) / (n - 1), the receive rate
S / (upload(1) - upload(tiny)), build, cutover (the router's flip) and retire; every replica's
commit + load + probe (fitted to a lognormal for the model); and one publication that fails
because an agent was SIGKILLed first (failure and rollback when the failure answers at once).
Beside them, this machine's own limit in the same run: sha256 and write+fsync throughput, and the
receive rate as a ratio of the smaller.

**Modelled** (``--help`` lists the knobs; defaults are stated assumptions):

- Node failures: a Poisson process per replica node, the per-GPU rate of the Llama 3 paper
  (419 unexpected interruptions in 54 days on 16,384 GPUs) times ``--gpus-per-replica`` (8: one
  replica per 8-GPU node, every interruption counted as one node failure). Repair (the node back,
  engine and agent up, store empty): lognormal, median ``--repair-median-s`` (30 min), sigma
  ``--repair-sigma`` (1.0, p99 ~5 h).
- A failed node stops answering. The router's health check sees it down after ``--detect-s``.
  A share ``--wedged`` of failures is a wedged engine behind an agent that still answers: the
  router does not see it, and each publication that tries it waits out a load timeout.
- The trainer computes for ``--step-s`` between publications and waits for each publication to
  return (synchronous RL: publish, then roll out on the new version).
- A publication: build + upload + max over the targets of (commit + load + probe) + cutover, then
  retire. The upload over the relay tree with fan-out f to n targets: fixed + S / min(rate,
  link / f) + depth(n, f) * h (the chain, f = 1, has depth n - 1); ``--link-gbps`` per node.
- **all-or-nothing** (today, on main): every replica is a target; one that does not answer costs
  ``--dead-s`` (124 s: issue 26, measured on main with one agent stopped), then everything rolls
  back, at every publication until it is repaired; a repaired node gets the next successful one.
- **all-or-nothing, fail fast** (issue 26 item 4): a replica the router already sees as down
  fails the publication at once (the measured killed-agent failure), one that does not answer its
  first call fails it after ``--first-call-s``; a wedged engine or a death mid-publication still
  costs ``--dead-s``.
- **quorum** (``min_replicas`` = ``--quorum`` of the fleet): replicas the router sees as down
  are skipped; one that fails a publication costs at most ``--grace-s`` after the others are done
  (then the publication returns) and is skipped with backoff (1, 2, 4, ... up to
  ``--backoff-max`` publications) until it catches up; below quorum it rolls back. A lagging or
  repaired replica catches up by itself: within ``--poll-s`` it learns what it lacks, fetches the
  active version from a peer (one hop at the measured rate), commits, loads, proves, and the router
  adds it; if a newer version became active meanwhile it fetches again.
- A relay hop that dies mid-upload stalls the chain below it for ``--stall-s`` (the Publisher's
  ``relay_stall_s``) before the Publisher resumes those copies itself.

Results per fleet size and policy: the fraction of publications that succeed, publication time
(to ``publish()`` returning) p50/p99, the time-mean fraction of the fleet serving the newest
version the trainer produced, catch-up time p50/p99 (a repaired node, from its return until it
serves the fleet's active version), node failures seen and trainer steps per hour. Seeded and
deterministic; the failure trace of each fleet size is shared by all policies.

Usage (measuring starts real processes: under the heavy lock):

    flock /tmp/lorafleet-heavy.lock .venv/bin/python bench/quorum_sim.py [--save-inputs in.json]
    .venv/bin/python bench/quorum_sim.py --inputs-from in.json [--fanouts 1,8] [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lorafleet.protocol.relay import RelayRates, plan_fanout, relay_time

MiB = 1 << 20
DAY = 86400.0
# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected
# interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
POLICIES = ("all-or-nothing", "all-or-nothing+ff", "quorum")


# -- measuring ----------------------------------------------------------------------------------
def measure(replicas: int, runs: int, rank: int, work: Path) -> dict:
    """Publish on a local reference fleet and return the per-phase figures (see the docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _limits import make_adapters, sha256_rate, write_fsync_rate
    from lorafleet.errors import PublishError
    from lorafleet.launch import Launcher
    from lorafleet.publisher import Publisher
    from lorafleet.testing import (
        make_peft_adapter,
        start_agent,
        start_reference_engine,
        start_router,
    )
    from lorafleet.tinymodel import ensure_tiny_model

    model = ensure_tiny_model()
    big = make_adapters(model, work / "big", 2 * (runs + 1) + 1, rank)
    small = [
        make_peft_adapter(model, work / f"small{i}", r=8, seed=500 + i) for i in range(runs + 1)
    ]
    weights = big[0] / "adapter_model.safetensors"
    size = sum(f.stat().st_size for f in big[0].iterdir() if f.name.startswith("adapter_"))
    sha = sha256_rate(weights)
    wf = write_fsync_rate(work, 64 * MiB)
    launcher = Launcher(work / "logs")
    token = secrets.token_urlsafe(12)
    try:
        engines = [
            start_reference_engine(launcher, model, max_lora_rank=rank) for _ in range(replicas)
        ]
        agents = [
            start_agent(
                launcher,
                e,
                work / f"agent{i}",
                token=token,
                extra=["--max-lora-rank", str(rank)],
                timeout=120,
            )
            for i, e in enumerate(engines)
        ]
        r1 = start_router(launcher, agents[:1], work / "router1", token=token)
        rn = start_router(launcher, agents, work / "routern", token=token, health_interval=0.2)
        one = Publisher([agents[0].url], router=r1.url, token=token)
        fleet = Publisher([a.url for a in agents], router=rn.url, token=token)
        up1, up_small, chain, phase, load, probe, commit = [], [], [], [], [], [], []
        build, cutover, retire, serving, duration = [], [], [], [], []
        it = iter(big)
        for i in range(runs + 1):  # the first round warms up
            rs = one.publish(str(small[i]), name="simtiny", transfer="relay")
            r_1 = one.publish(str(next(it)), name="simone", transfer="relay")
            r_n = fleet.publish(str(next(it)), name="simfleet", transfer="relay")
            print(
                f"  round {i}: tiny {rs.replicas[next(iter(rs.replicas))].upload_s * 1e3:.0f} ms, "
                f"one {r_1.duration_s:.3f} s, fleet of {replicas} {r_n.duration_s:.3f} s",
                flush=True,
            )
            if i == 0:
                continue
            up_small.append(max(t.upload_s for t in rs.replicas.values()))
            up1.append(max(t.upload_s for t in r_1.replicas.values()))
            chain.append(max(t.upload_s for t in r_n.replicas.values()))
            for t in r_n.replicas.values():
                phase.append(t.verify_s + t.load_s + t.probe_s)
                load.append(t.load_s)
                probe.append(t.probe_s)
                commit.append(t.verify_s)
            build.append(r_n.build_s)
            cutover.append(r_n.cutover_s)
            retire.append(r_n.retire_s)
            serving.append(r_n.serving_s)
            duration.append(r_n.duration_s)
        # A publication that fails: the last agent killed (its port answers with a reset at once,
        # so this is the failure's handling and the rollback, not a timeout).
        agents[-1].proc.kill()
        t = time.perf_counter()
        try:
            fleet.publish(str(next(it)), name="simfleet", transfer="relay")
            fail_s = float("nan")
        except PublishError:
            fail_s = time.perf_counter() - t
        one.close()
        fleet.close()
    finally:
        launcher.stop_all()
    m = statistics.median
    hop = max((m(chain) - m(up1)) / (replicas - 1), 0.0)
    recv = size / max(m(up1) - m(up_small), 1e-6)
    return {
        "source": "measured",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
        "replicas": replicas,
        "runs": runs,
        "rank": rank,
        "adapter_bytes": size,
        "sha256_Bps": sha,
        "write_fsync_Bps": wf,
        "upload_one_s": m(up1),
        "upload_tiny_s": m(up_small),
        "upload_chain_s": m(chain),
        "hop_s": hop,
        "recv_Bps": recv,
        "recv_over_limit": recv / min(sha, wf),
        "build_s": m(build),
        "cutover_s": m(cutover),
        "retire_s": m(retire),
        "serving_s": m(serving),
        "duration_s": m(duration),
        "commit_s": m(commit),
        "load_s": m(load),
        "probe_s": m(probe),
        "phase_samples_s": phase,
        "fail_s": fail_s,
    }


# -- the model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """The modelled inputs (assumptions, not measurements); see the module docstring."""

    gpus_per_replica: int = 8
    repair_median_s: float = 1800.0
    repair_sigma: float = 1.0
    wedged: float = 0.25
    detect_s: float = 5.0
    step_s: float = 60.0
    link_gbps: float = 25.0
    dead_s: float = 124.0
    first_call_s: float = 5.0
    quorum: float = 0.9
    grace_s: float = 10.0
    backoff_max: int = 32
    poll_s: float = 1.0
    stall_s: float = 10.0
    adapter_mib: float | None = None
    """Scale the byte-proportional part of the upload to this size (None: the measured one)."""

    @property
    def node_rate(self) -> float:
        """Failures per second of one replica node."""
        per_gpu = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * DAY)
        return per_gpu * self.gpus_per_replica


@dataclass(frozen=True)
class Costs:
    """The measured figures the model uses, in seconds and bytes/s."""

    bytes: float
    fixed_s: float
    recv_Bps: float
    hop_s: float
    build_s: float
    cutover_s: float
    retire_s: float
    fail_s: float
    phase_mu: float
    phase_sigma: float

    @classmethod
    def of(cls, inputs: dict, model: Model) -> Costs:
        logs = [math.log(x) for x in inputs["phase_samples_s"] if x > 0]
        nbytes = inputs["adapter_bytes"]
        if model.adapter_mib is not None:
            nbytes = model.adapter_mib * MiB
        fail = inputs["fail_s"]
        return cls(
            bytes=nbytes,
            fixed_s=inputs["upload_tiny_s"],
            recv_Bps=inputs["recv_Bps"],
            hop_s=inputs["hop_s"],
            build_s=inputs["build_s"] * nbytes / inputs["adapter_bytes"],
            cutover_s=inputs["cutover_s"],
            retire_s=inputs["retire_s"],
            fail_s=fail if math.isfinite(fail) else inputs["duration_s"],
            phase_mu=statistics.fmean(logs),
            phase_sigma=statistics.pstdev(logs) if len(logs) > 1 else 0.0,
        )


def upload_s(c: Costs, m: Model, n: int, fanout: int) -> float:
    """The relay's time to land one copy on each of ``n`` targets: a tree of ``fanout``, or
    (``fanout`` 0) the one the Publisher plans by default (``protocol/relay.plan_fanout``, told
    the model's link and the measured receive rate and per-hop time)."""
    if n <= 0:
        return 0.0
    rates = RelayRates(
        link_Bps=m.link_gbps * 1e9 / 8, recv_Bps=c.recv_Bps, hop_s=c.hop_s, fixed_s=c.fixed_s
    )
    f = fanout or plan_fanout(n, c.bytes, rates)
    # The measured fixed cost includes the first hop: the tree's levels below the root follow.
    return relay_time(n, c.bytes, f, rates) - c.hop_s


# Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9).
_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
      1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)  # fmt: skip
_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
      6.680131188771972e01, -1.328068155288572e01)  # fmt: skip
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
      -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)  # fmt: skip
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)


def _poly(cs: Sequence[float], x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    for c in cs:
        out = out * x + c
    return out


def norm_upper_ppf(q: np.ndarray) -> np.ndarray:
    """z with P(Z > z) = q, precise for tiny q (the max of thousands of draws needs that)."""
    q = np.clip(q, 1e-300, 1 - 1e-16)
    p = np.minimum(q, 1 - q)  # the smaller tail, computed as the lower one
    z = np.empty_like(p)
    tail = p < 0.02425
    r = np.sqrt(-2 * np.log(p[tail]))
    z[tail] = _poly(_C, r) / (_poly(_D, r) * r + 1)
    x = p[~tail] - 0.5
    s = x * x
    z[~tail] = _poly(_A, s) * x / (_poly(_B, s) * s + 1)
    return np.where(q < 0.5, -z, z)  # z is the lower-tail quantile of p (negative for small p)


def phase_max(c: Costs, rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``size`` draws of the slowest of ``n`` replicas' commit + load + probe (lognormal)."""
    if n <= 0:
        return np.zeros(size)
    u = rng.random(size)
    q = -np.expm1(np.log(u) / n)  # P(one replica slower than the max) for the max's quantile u
    return np.exp(c.phase_mu + c.phase_sigma * norm_upper_ppf(q))


_NORMAL = statistics.NormalDist()


def phase_max1(c: Costs, rng: np.random.Generator, n: int) -> float:
    """One draw of ``phase_max`` without numpy's per-call overhead (the hot path)."""
    if n <= 0:
        return 0.0
    q = -math.expm1(math.log(rng.random() or 1e-300) / n)
    return math.exp(c.phase_mu - c.phase_sigma * _NORMAL.inv_cdf(min(max(q, 1e-300), 1 - 1e-16)))


@dataclass
class Trace:
    """Every node failure of one fleet over the horizon, sorted by time: shared by the policies."""

    t_fail: np.ndarray
    t_repair: np.ndarray
    node: np.ndarray
    wedged: np.ndarray


def failure_trace(n: int, horizon: float, m: Model, rng: np.random.Generator) -> Trace:
    t = np.zeros(n)
    fails, repairs, nodes = [], [], []
    alive = np.arange(n)
    while alive.size:
        tf = t[alive] + rng.exponential(1 / m.node_rate, alive.size)
        keep = tf < horizon
        alive, tf = alive[keep], tf[keep]
        tr = tf + rng.lognormal(math.log(m.repair_median_s), m.repair_sigma, alive.size)
        fails.append(tf)
        repairs.append(tr)
        nodes.append(alive)
        t[alive] = tr
    tf, tr, nd = (np.concatenate(x) if x else np.zeros(0) for x in (fails, repairs, nodes))
    order = np.argsort(tf, kind="stable")
    wedged = rng.random(order.size) < m.wedged
    return Trace(tf[order], tr[order], nd[order].astype(int), wedged)


@dataclass
class Lag:
    """A replica that is up but does not hold the active version."""

    since: float
    record: bool
    """Whether its catch-up time is recorded (a repaired node, not a straggler)."""
    token: int = 0
    fetching: int | None = None
    """The version its running catch-up attempt fetches."""


@dataclass
class Stats:
    """One (fleet, policy) run; durations are binned (log-spaced) to keep millions cheap."""

    pubs: int = 0
    ok: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(len(_EDGES) + 1, dtype=np.int64))
    catchup: list[float] = field(default_factory=list)
    newest_integral: float = 0.0
    hourly: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Replica-seconds serving the newest version, per hour of the run."""
    span: float = 0.0
    failures: int = 0

    def add(self, durations: np.ndarray, ok: int) -> None:
        self.pubs += durations.size
        self.ok += ok
        np.add.at(self.hist, np.searchsorted(_EDGES, durations), 1)

    def quantile(self, q: float) -> float:
        if not self.pubs:
            return float("nan")
        i = int(np.searchsorted(np.cumsum(self.hist), q * self.pubs))
        return float(_EDGES[min(i, len(_EDGES) - 1)])


_EDGES = np.geomspace(1e-3, 1e5, 2000)  # 0.9% wide: quantiles to within a percent


class Fleet:
    """One policy over one failure trace. Healthy, current replicas are not tracked one by one:
    only the down, the lagging and those in backoff are, so a step costs O(those), not O(N)."""

    def __init__(
        self, n: int, policy: str, fanout: int, trace: Trace, c: Costs, m: Model, seed: list[int]
    ) -> None:
        self.n, self.policy, self.fanout = n, policy, fanout
        self.trace, self.c, self.m = trace, c, m
        self.rng = np.random.default_rng(seed)
        self.stats = Stats()
        self.quorum = policy == "quorum"
        self.need = math.ceil(m.quorum * n) if self.quorum else n
        self.down: dict[int, tuple[float, bool]] = {}  # node -> (failed at, wedged)
        self.behind: dict[int, Lag] = {}
        self.in_flight = False
        self.caught_in_flight: set[int] = set()
        self.backoff: dict[int, tuple[int, int]] = {}  # wedged node -> (next try, skip length)
        self.events: list[tuple[float, int, str, int, int]] = []  # repairs and catch-ups
        self.fp = 0  # next failure in the trace
        self.seq = 0
        self.pub_index = 0
        self.active = 0  # newest version that became active
        self.produced = 0  # newest version the trainer produced
        self.last_t = 0.0
        self.q_fetch = upload_s(c, m, 1, 1) + c.cutover_s  # one hop from a peer + the router's add

    # serving newest: the replicas holding the active version, while it is the newest produced
    def _serving(self) -> int:
        if self.active != self.produced:
            return 0
        return self.n - len(self.down) - len(self.behind)

    def _mark(self, t: float) -> None:
        self._spread(self.last_t, t, (t - self.last_t) * self._serving())
        self.last_t = t

    def _spread(self, t0: float, t1: float, amount: float) -> None:
        """Add ``amount`` replica-seconds over [t0, t1), evenly, to the total and the hours."""
        if amount <= 0 or t1 <= t0:
            return
        self.stats.newest_integral += amount
        h = self.stats.hourly
        a, b = int(t0 // 3600), min(int(t1 // 3600), h.size - 1)
        if a >= h.size:
            return
        if a == b:
            h[a] += amount
            return
        rate = amount / (t1 - t0)
        h[a] += ((a + 1) * 3600 - t0) * rate
        h[a + 1 : b] += 3600 * rate
        h[b] += (t1 - b * 3600) * rate

    def _push(self, t: float, kind: str, node: int, token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, node, token))

    def _catchup(self, node: int, t: float) -> None:
        lag = self.behind[node]
        self.seq += 1
        lag.token = self.seq  # unique: a stale attempt of an earlier lag never matches
        lag.fetching = self.active
        c, m = self.c, self.m
        took = self.rng.random() * m.poll_s + self.q_fetch + phase_max1(c, self.rng, 1)
        self._push(t + took, "caught", node, lag.token)

    def advance(self, until: float) -> None:
        """Process failures, repairs and catch-ups up to ``until``, in time order."""
        tr = self.trace
        while True:
            tf = tr.t_fail[self.fp] if self.fp < tr.t_fail.size else math.inf
            te = self.events[0][0] if self.events else math.inf
            t = min(tf, te)
            if t > until:
                break
            self._mark(t)
            if tf <= te:
                node, wedged = int(tr.node[self.fp]), bool(tr.wedged[self.fp])
                self._push(float(tr.t_repair[self.fp]), "repair", node)
                self.fp += 1
                self.stats.failures += 1
                self.behind.pop(node, None)
                self.down[node] = (t, wedged)
                continue
            _, _, kind, node, token = heapq.heappop(self.events)
            if kind == "repair":
                del self.down[node]
                self.backoff.pop(node, None)
                self.behind[node] = Lag(since=t, record=True)  # back, empty
                if self.quorum:
                    self._catchup(node, t)
            elif kind == "caught":
                lag = self.behind.get(node)
                if lag is None or lag.token != token:
                    continue  # failed since
                if lag.fetching == self.active:
                    if lag.record:
                        self.stats.catchup.append(t - lag.since)
                    del self.behind[node]
                    if self.in_flight:  # not a target of the running publication: lags again
                        self.caught_in_flight.add(node)
                else:
                    self._catchup(node, t)  # a newer version became active meanwhile
        self._mark(until)

    def quiet(self) -> bool:
        return not self.down and not self.behind and not self.events

    def run(self, horizon: float) -> Stats:
        c, m, n = self.c, self.m, self.n
        base = c.build_s + upload_s(c, m, n, self.fanout) + c.cutover_s
        t_end = 0.0
        self.stats.hourly = np.zeros(int(horizon // 3600) + 2)
        self.last_t = m.step_s
        start = m.step_s
        while t_end + m.step_s < horizon:
            if self.quiet():
                t_end = self._quiet_batch(t_end, base, horizon)
                if t_end + m.step_s >= horizon:
                    break
            t_end = self.publish(t_end + m.step_s)
        self._mark(max(t_end, self.last_t))
        self.stats.span = self.last_t - start
        return self.stats

    def _quiet_batch(self, t_end: float, base: float, horizon: float) -> float:
        """Publications while nothing is down or lagging, until the next failure: vectorised."""
        c, m = self.c, self.m
        tf = self.trace.t_fail[self.fp] if self.fp < self.trace.t_fail.size else math.inf
        limit = min(tf, horizon)
        while True:
            v = base + phase_max(c, self.rng, self.n, 4096)
            cycle = m.step_s + v + c.retire_s
            ends = t_end + np.cumsum(cycle)  # each publication's return
            fits = int(np.searchsorted(ends + m.step_s, limit, side="right"))
            if fits == 0:
                return t_end
            self.stats.add(v[:fits] + c.retire_s, fits)
            self.pub_index += fits
            self.produced += fits
            self.active = self.produced
            s_first = t_end + m.step_s
            t_end = float(ends[fits - 1])
            # serving the newest: everyone, from each flip to the next publication's start
            self._mark(s_first)
            self._spread(s_first, t_end + m.step_s, self.n * fits * (c.retire_s + m.step_s))
            self.last_t = t_end + m.step_s
            if fits < cycle.size:
                return t_end

    def publish(self, s: float) -> float:
        """One publication starting at ``s``; returns when ``publish()`` returns."""
        c, m = self.c, self.m
        self.advance(s)
        self.produced += 1
        version = self.produced
        self.pub_index += 1
        self.in_flight = True
        self.caught_in_flight.clear()
        known = {k for k, (tf, w) in self.down.items() if not w and tf <= s - m.detect_s}
        if self.quorum:
            skipped = set(known) | set(self.behind)
            for k, (nxt, _) in self.backoff.items():
                if self.pub_index < nxt:
                    skipped.add(k)
            targets = self.n - len(skipped)
        else:
            skipped = set()
            targets = self.n
        # The failed replicas among the targets: when their failure is known (s from start).
        bad: dict[int, float] = {}
        for k, (_, w) in self.down.items():
            if k in skipped:
                continue
            if self.policy == "all-or-nothing" or w:
                bad[k] = m.dead_s
            elif k in known:
                bad[k] = 0.0
            else:
                bad[k] = m.first_call_s
        up = upload_s(c, m, targets, self.fanout)
        v0 = c.build_s + up + phase_max1(c, self.rng, targets) + c.cutover_s
        # Deaths during the publication (of targets: the rest do not change its outcome).
        v = self._end(v0, bad)
        tr = self.trace
        while self.fp < tr.t_fail.size and tr.t_fail[self.fp] < s + v:
            tf, node = float(tr.t_fail[self.fp]), int(tr.node[self.fp])
            was_target = node not in skipped and node not in self.down
            self.advance(tf)
            if was_target:
                bad[node] = tf - s + m.dead_s
                if tf - s < c.build_s + up:
                    v0 += m.stall_s  # the relay below it stalls, then the Publisher resumes it
                v = self._end(v0, bad)
        ok = targets - len(bad) >= self.need
        self.advance(s + v)
        if ok:
            self.active = version
            if self.quorum:
                for k in bad:
                    if k in self.down and self.down[k][1]:
                        _, skip = self.backoff.get(k, (0, 0))
                        skip = min(max(1, 2 * skip), m.backoff_max)
                        self.backoff[k] = (self.pub_index + 1 + skip, skip)
                # Replicas lagging now refetch when their running attempt ends (it sees the newer
                # active version); those that caught up to the old one meanwhile chase this one.
                for k in self.caught_in_flight:
                    if k not in self.down and k not in self.behind:
                        self.behind[k] = Lag(since=s + v, record=False)
                        self._catchup(k, s + v)
            else:
                for k, lag in list(self.behind.items()):  # every target got it, the empty too
                    if lag.since <= s:
                        if lag.record:
                            self.stats.catchup.append(s + v - lag.since)
                        del self.behind[k]
            end = s + v + c.retire_s
        else:
            if self.quorum:
                for k in bad:
                    if k in self.down and self.down[k][1]:
                        _, skip = self.backoff.get(k, (0, 0))
                        skip = min(max(1, 2 * skip), m.backoff_max)
                        self.backoff[k] = (self.pub_index + 1 + skip, skip)
            end = s + v + c.fail_s
        self.in_flight = False
        self.stats.add(np.array([end - s]), int(ok))
        return end

    def _end(self, v0: float, bad: dict[int, float]) -> float:
        """When the publication's outcome is known (relative to its start)."""
        if not bad:
            return v0
        worst = max(bad.values())
        if self.quorum:
            return max(v0, min(worst, v0 + self.m.grace_s))
        if self.policy == "all-or-nothing+ff":
            return min(bad.values())  # the first failure named ends it
        return max(v0, worst)


def worst_hours(st: Stats, n: int) -> float:
    """The 1st percentile over the run's whole hours of the fraction serving the newest."""
    first, last = 1, int((st.span + 60) // 3600) - 1  # whole hours only
    hours = st.hourly[first:last] / (3600 * n)
    return float(np.percentile(hours, 1)) if hours.size else math.nan


def simulate(
    inputs: dict,
    m: Model,
    sizes: Sequence[int],
    fanouts: Sequence[int],
    days: float,
    min_failures: int,
    max_days: float,
    seed: int,
) -> list[dict]:
    """Every (fleet size, fan-out, policy): one row of figures (see ``print_rows``)."""
    c = Costs.of(inputs, m)
    rows = []
    for n in sizes:
        horizon = min(max(days * DAY, min_failures / (n * m.node_rate)), max_days * DAY)
        trace = failure_trace(n, horizon, m, np.random.default_rng([seed, n]))
        for f in fanouts:
            for pi, policy in enumerate(POLICIES):
                t0 = time.perf_counter()
                fleet = Fleet(n, policy, f, trace, c, m, seed=[seed, n, f, pi])
                st = fleet.run(horizon)
                cu = np.array(st.catchup) if st.catchup else np.array([math.nan])
                rows.append(
                    {
                        "replicas": n,
                        "fanout": f,
                        "policy": policy,
                        "days": horizon / DAY,
                        "publications": st.pubs,
                        "succeed": st.ok / st.pubs if st.pubs else math.nan,
                        "pub_p50_s": st.quantile(0.5),
                        "pub_p99_s": st.quantile(0.99),
                        "serving_newest": st.newest_integral / (n * st.span),
                        "serving_newest_worst_hour_p1": worst_hours(st, n),
                        "catchup_p50_s": float(np.nanpercentile(cu, 50)),
                        "catchup_p99_s": float(np.nanpercentile(cu, 99)),
                        "catchups": len(st.catchup),
                        "failures": st.failures,
                        "steps_per_h": st.pubs / (st.span / 3600),
                        "cpu_s": time.perf_counter() - t0,
                    }
                )
    return rows


# -- output -------------------------------------------------------------------------------------
def print_inputs(inputs: dict, m: Model, c: Costs) -> None:
    i, src = inputs, f"[{inputs['source']}]"
    ms = {k: v * 1e3 for k, v in i.items() if k.endswith("_s") and isinstance(v, float)}
    lines = [
        f"Inputs ({i['when']}, {i['replicas']} reference replicas on {i['cores']} cores, load "
        f"{i['loadavg']}; medians of {i['runs']} runs):",
        f"{src} adapter {i['adapter_bytes'] / MiB:.2f} MiB (all-linear r={i['rank']})",
        f"{src} upload to one agent {ms['upload_one_s']:.1f} ms; a 60 KB adapter (the fixed "
        f"cost) {ms['upload_tiny_s']:.1f} ms; the relay chain of {i['replicas']} "
        f"{ms['upload_chain_s']:.1f} ms",
        f"{src} per hop h = {ms['hop_s']:.1f} ms; receive rate {i['recv_Bps'] / MiB:.0f} MiB/s = "
        f"{i['recv_over_limit']:.2f} x this machine's limit in the same run (sha256 "
        f"{i['sha256_Bps'] / MiB:.0f}, write+fsync {i['write_fsync_Bps'] / MiB:.0f} MiB/s)",
        f"{src} per replica: commit {ms['commit_s']:.1f}, load {ms['load_s']:.1f}, probe "
        f"{ms['probe_s']:.1f} ms; commit+load+probe ~ lognormal(mu={c.phase_mu:.3f}, "
        f"sigma={c.phase_sigma:.3f}), median {math.exp(c.phase_mu) * 1e3:.1f} ms, "
        f"n={len(i['phase_samples_s'])}",
        f"{src} build {ms['build_s']:.1f}, cutover (the flip) {ms['cutover_s']:.1f}, retire "
        f"{ms['retire_s']:.1f} ms; serving {ms['serving_s']:.1f}, publish() returns "
        f"{ms['duration_s']:.1f} ms; a publication with one agent killed fails in "
        f"{ms['fail_s']:.1f} ms",
        f"[modelled] node failures: {LLAMA3_INTERRUPTIONS} in {LLAMA3_DAYS} d on {LLAMA3_GPUS} "
        f"GPUs, {m.gpus_per_replica} GPUs per replica: MTBF {1 / m.node_rate / DAY:.0f} d per "
        f"replica; repair lognormal, median {m.repair_median_s:.0f} s, sigma {m.repair_sigma}; "
        f"wedged share {m.wedged}; the router sees a dead node after {m.detect_s} s",
        f"[modelled] step {m.step_s} s; link {m.link_gbps} Gbit/s; a replica that does not "
        f"answer costs {m.dead_s} s (main), first-call bound {m.first_call_s} s (fail fast); "
        f"quorum {m.quorum}, grace {m.grace_s} s, backoff up to {m.backoff_max} publications; "
        f"catch-up poll {m.poll_s} s; relay stall {m.stall_s} s"
        + (f"; adapter scaled to {m.adapter_mib} MiB" if m.adapter_mib else ""),
    ]
    for key, was in inputs.get("overridden", {}).items():
        lines.append(f"[override] {key} = {inputs[key]:g} (measured {was:g}): used above and below")
    print("\n" + "\n  ".join(lines))


def print_rows(rows: list[dict]) -> None:
    for f in sorted({r["fanout"] for r in rows}):
        what = "a chain" if f == 1 else "a tree" if f else "planned by the Publisher for each N"
        print(f"\nRelay fan-out {f or 'planned'} ({what}):\n")
        print(
            "| replicas | policy | succeed | publish p50 / p99 s | serving newest (worst 1% h) | "
            "catch-up p50 / p99 s | failures (days) | published / tried per h |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["fanout"] != f:
                continue
            print(
                f"| {r['replicas']} | {r['policy']} | {100 * r['succeed']:.2f}% | "
                f"{r['pub_p50_s']:.2f} / {r['pub_p99_s']:.2f} | "
                f"{100 * r['serving_newest']:.2f}% "
                f"({100 * r['serving_newest_worst_hour_p1']:.1f}%) | "
                f"{r['catchup_p50_s']:.1f} / {r['catchup_p99_s']:.1f} | "
                f"{r['failures']} ({r['days']:.0f}) | "
                f"{r['succeed'] * r['steps_per_h']:.1f} / {r['steps_per_h']:.1f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs-from", type=Path, help="reuse recorded inputs (skip measuring)")
    ap.add_argument("--save-inputs", type=Path, help="write the measured inputs here")
    ap.add_argument("--json", type=Path, help="write the result rows here")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=SECONDS",
        help="replace one measured input (e.g. hop_s=0.035); printed as an override",
    )
    ap.add_argument("--quick", action="store_true", help="3 sizes, short horizon, 2 runs")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rank", type=int, default=1024)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--fanouts", default="1,8,0", help="0: the Publisher's planned fan-out")
    ap.add_argument("--days", type=float, default=180.0)
    ap.add_argument("--min-failures", type=int, default=100)
    ap.add_argument("--max-days", type=float, default=3650.0)
    ap.add_argument("--seed", type=int, default=26)
    d = Model()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        kind = float if name != "gpus_per_replica" and name != "backoff_max" else int
        ap.add_argument(flag, type=kind, default=value)
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.days, a.min_failures, a.max_days = "16,256,4096", 30.0, 20, 365.0
        a.runs = min(a.runs, 2)
    m = Model(**{k: getattr(a, k) for k in asdict(d)})
    if a.inputs_from:
        inputs = json.loads(a.inputs_from.read_text())
        inputs["source"] = f"recorded ({a.inputs_from.name})"
    else:
        with tempfile.TemporaryDirectory(prefix="lf-bench-quorum-") as tmp:
            print(f"measuring: {a.replicas} reference replicas, {a.runs} runs, r={a.rank}")
            inputs = measure(a.replicas, a.runs, a.rank, Path(tmp))
        if a.save_inputs:
            a.save_inputs.write_text(json.dumps(inputs, indent=1) + "\n")
    for item in a.override:
        key, _, value = item.partition("=")
        if key not in inputs or not isinstance(inputs[key], float):
            ap.error(f"--override: {key!r} is not a measured figure")
        inputs.setdefault("overridden", {})[key] = inputs[key]
        inputs[key] = float(value)
    c = Costs.of(inputs, m)
    print_inputs(inputs, m, c)
    t = time.perf_counter()
    sizes = [int(x) for x in a.sizes.split(",")]
    fanouts = [int(x) for x in a.fanouts.split(",")]
    rows = simulate(inputs, m, sizes, fanouts, a.days, a.min_failures, a.max_days, a.seed)
    print_rows(rows)
    print(f"\nsimulated in {time.perf_counter() - t:.1f} s (seed {a.seed})")
    if a.json:
        a.json.write_text(
            json.dumps({"inputs": inputs, "model": asdict(m), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
