"""S2: targets q k v o, max-loaded-loras 2, max-loras-per-batch 1, skip warmup. Limits, eviction, symlink in-place, crash."""
import os, shutil, signal, subprocess, threading
from common import *

s = Server(log="study3", targets=("q_proj", "k_proj", "v_proj", "o_proj"), max_loaded_loras=2, max_loras_per_batch=1,
           extra=("--skip-server-warmup",))
rec("argv", s.argv)
try:
    rec("ready_s (/ready 200)", round(s.start(), 1)); rec("loadavg", open("/proc/loadavg").read())
    time.sleep(1); rec("rss_idle", s.rss())
    st, b, _ = http("GET", s.url + "/server_info")
    rec("server_info lora", {k: b.get(k) for k in ["max_lora_rank", "max_loras_per_batch", "max_loaded_loras", "lora_target_modules", "served_model_name", "skip_server_warmup"]})
    rec("first gen base (cold, no warmup)", g(s.url, None))
    # targets outside
    for n in ["all_s3", "gateup", "mts", "bias"]:
        r = load(s.url, n, f"{A}/{n}"); rec(f"LIM load {n}", r)
        if r[0] == 200:
            rec(f"LIM gen {n}", g(s.url, n)); unload(s.url, n)
    # eviction
    rec("EV load e1", load(s.url, "e1", f"{A}/qkvo_s1"))
    rec("EV load e2", load(s.url, "e2", f"{A}/qkvo_s2"))
    rec("EV gen e1 (touch)", g(s.url, "e1"))
    rec("EV load e3", load(s.url, "e3", f"{A}/qkvo_s1"))
    rec("EV models after e3", models(s.url))
    rec("EV gen e2 (evicted?)", g(s.url, "e2"))
    rec("EV models after gen e2", models(s.url))
    rec("EV batch of 3 distinct", (lambda r: (r[0], [who(x["output_ids"]) for x in r[1]] if r[0] == 200 else r[1]))(
        gen(s.url, input_ids=[PIDS] * 3, sampling_params={"temperature": 0, "max_new_tokens": 8}, lora_path=["e1", "e2", "e3"])))
    rec("EV batch of 2 distinct + base (per-batch 1)", (lambda r: (r[0], [who(x["output_ids"]) for x in r[1]] if r[0] == 200 else r[1]))(
        gen(s.url, input_ids=[PIDS] * 3, sampling_params={"temperature": 0, "max_new_tokens": 8}, lora_path=["e1", "e2", None])))
    rec("EV models", models(s.url))
    # evicted adapter whose files are gone
    G = "/tmp/sgl-study/gone3"; shutil.rmtree(G, ignore_errors=True); shutil.copytree(f"{A}/qkvo_s2", G)
    for n in [x[0] for x in models(s.url) if x[0] != "tiny"]:
        unload(s.url, n)
    rec("EVG load g1", load(s.url, "g1", G)); rec("EVG load g2", load(s.url, "g2", f"{A}/qkvo_s1"))
    rec("EVG load g3 (evicts g1)", load(s.url, "g3", f"{A}/qkvo_s1"))
    shutil.rmtree(G)
    rec("EVG gen g1 (evicted, files gone)", g(s.url, "g1"))
    rec("EVG ready after", http("GET", s.url + "/ready", raw=True))
    rec("EVG gen g2 still fine", g(s.url, "g2"))
    for n in [x[0] for x in models(s.url) if x[0] != "tiny"]:
        unload(s.url, n)
    # pinned
    rec("PIN load p1 pinned", load(s.url, "p1", f"{A}/qkvo_s1", pinned=True))
    rec("PIN load p2 pinned", load(s.url, "p2", f"{A}/qkvo_s2", pinned=True))
    rec("PIN load p3", load(s.url, "p3", f"{A}/qkvo_s1"))
    rec("PIN models", models(s.url))
    for n in [x[0] for x in models(s.url) if x[0] != "tiny"]:
        rec(f"PIN unload {n}", unload(s.url, n))
    # ---- in-place via a stable per-name path whose target is swapped (symlink)
    L = "/tmp/sgl-study/names"; os.makedirs(L, exist_ok=True)
    link = f"{L}/S"
    if os.path.lexists(link): os.unlink(link)
    os.symlink(f"{A}/qkvo_s1", link)
    rec("SYM load S<-link(s1)", load(s.url, "S", link)); rec("SYM gen S", g(s.url, "S"))
    tmp = link + ".tmp"; os.symlink(f"{A}/qkvo_s2", tmp); os.replace(tmp, link)
    rec("SYM gen S after swap (still in memory)", g(s.url, "S"))
    rec("SYM unload S", unload(s.url, "S"))
    rec("SYM gen S between (implicit reload reads link)", g(s.url, "S"))
    rec("SYM load S<-link after implicit reload", load(s.url, "S", link))
    rec("SYM gen S", g(s.url, "S"))
    rec("SYM models", models(s.url))
    # upsert-free in-place protocol timing: unload + load
    t = time.perf_counter()
    tmp = link + ".tmp"; os.symlink(f"{A}/qkvo_s1", tmp); os.replace(tmp, link)
    u = unload(s.url, "S"); l = load(s.url, "S", link)
    rec("SYM swap+unload+load ms", {"total_ms": round((time.perf_counter() - t) * 1000, 1), "unload": u[0], "load": l[0]})
    rec("SYM gen S", g(s.url, "S"))
    rec("rss_end", s.rss())
    # ---- crash: SIGKILL the launch pid
    pid = s.proc.pid
    kids_before = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    s.kill9(); s.proc.wait(); time.sleep(3)
    alive = [p for p in kids_before if os.path.exists(f"/proc/{p}")]
    names = {p: open(f"/proc/{p}/comm").read().strip() for p in alive}
    rec("CRASH children after SIGKILL of launch pid (3s)", names)
    time.sleep(10)
    alive2 = {p: open(f"/proc/{p}/comm").read().strip() for p in kids_before if os.path.exists(f"/proc/{p}")}
    rec("CRASH children after 13s", alive2)
    try:
        rec("CRASH port after kill", http("GET", s.url + "/ready", raw=True, timeout=3))
    except Exception as e:
        rec("CRASH port after kill", repr(e))
    for p in alive2:
        os.kill(int(p), signal.SIGKILL)
    time.sleep(1)
    s2 = Server(log="study3-restart", targets=("q_proj", "k_proj", "v_proj", "o_proj"), max_loaded_loras=2, max_loras_per_batch=1,
                extra=("--skip-server-warmup",))
    rec("CRASH restart ready_s", round(s2.start(), 1)); rec("loadavg", open("/proc/loadavg").read())
    rec("CRASH models after restart", models(s2.url))
    rec("CRASH gen S after restart", g(s2.url, "S"))
    rec("CRASH completions tiny:S after restart", comp(s2.url, model="tiny:S", prompt=PIDS, max_tokens=2, temperature=0))
    rec("CRASH load S again", load(s2.url, "S", link)); rec("CRASH gen S", g(s2.url, "S"))
    rec("left2", s2.stop())
finally:
    rec("left", s.stop())
    json.dump(out, open("study3.json", "w"), indent=1, default=str)
