"""Names with @ : /, overlap schedule on, in-place protocol under traffic, n>1 then unload."""
import os, threading
from common import *
s = Server(log="study5", targets=("all",), extra=("--skip-server-warmup",))
s.argv.remove("--disable-overlap-schedule")
rec("argv", s.argv)
try:
    rec("ready_s (overlap schedule ON)", round(s.start(), 1)); rec("loadavg", open("/proc/loadavg").read())
    rec("v1/models/tiny", http("GET", s.url + "/v1/models/tiny"))
    for name in ["policy@v7", "ns:v7", "a/b", "sp ace"]:
        r = load(s.url, name, f"{A}/qkvo_s1"); rec(f"NAME load {name!r}", r[:2])
        if r[0] == 200:
            rec(f"NAME generate lora_path={name!r}", g(s.url, name))
            st, b, _ = comp(s.url, model=f"tiny:{name}", prompt=PIDS, max_tokens=8, temperature=0, return_token_ids=True)
            rec(f"NAME completions model=tiny:{name}", (st, b.get("model"), who(b["choices"][0]["token_ids"]) if st == 200 else b))
            rec(f"NAME unload {name!r}", unload(s.url, name)[:2])
    # n>1 with adapter, then unload (SGLang #36894)
    rec("N2 load", load(s.url, "n2", f"{A}/qkvo_s1")[0])
    st, b, _ = comp(s.url, model="tiny:n2", prompt=PIDS, max_tokens=8, temperature=0.8, n=2)
    rec("N2 completions n=2", (st, len(b.get("choices", [])) if st == 200 else b))
    st, b, _ = gen(s.url, input_ids=PIDS, sampling_params={"max_new_tokens": 8, "temperature": 0.8, "n": 2}, lora_path="n2")
    rec("N2 generate n=2", (st, len(b) if st == 200 and isinstance(b, list) else b))
    try:
        rec("N2 unload after n=2", http("POST", s.url + "/unload_lora_adapter", {"lora_name": "n2"}, timeout=30))
    except Exception as e:
        rec("N2 unload after n=2", repr(e))
    rec("N2 ready", http("GET", s.url + "/ready", raw=True, timeout=5))
    # in-place protocol under traffic: per-name link swapped, then unload+load
    L = "/tmp/sgl-study/names"; os.makedirs(L, exist_ok=True); link = f"{L}/T"
    if os.path.lexists(link): os.unlink(link)
    os.symlink(f"{A}/qkvo_s1", link)
    rec("TRAF load T", load(s.url, "T", link)[0])
    stop = threading.Event(); seen = []
    def hammer(k):
        while not stop.is_set():
            t = time.perf_counter()
            st, b, _ = gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 4}, lora_path="T")
            res = who(b["output_ids"] + REF["ids"]["qkvo_s1"][P][4:]) if st == 200 else None
            # classify by the first 4 tokens
            if st == 200:
                ids = b["output_ids"]
                res = "s1" if ids == REF["ids"]["qkvo_s1"][P][:4] else "s2" if ids == REF["ids"]["qkvo_s2"][P][:4] else f"other{ids}"
            else:
                res = f"ERR{st}:{str(b)[:120]}"
            seen.append((round(t - T0, 3), round(time.perf_counter() - T0, 3), k, res))
    T0 = time.perf_counter()
    ths = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
    [t.start() for t in ths]
    time.sleep(1.5)
    t_swap = time.perf_counter() - T0
    tmp = link + ".tmp"; os.symlink(f"{A}/qkvo_s2", tmp); os.replace(tmp, link)
    u = unload(s.url, "T"); t_unl = time.perf_counter() - T0
    l = load(s.url, "T", link); t_load = time.perf_counter() - T0
    time.sleep(1.5); stop.set(); [t.join() for t in ths]
    rec("TRAF protocol", {"swap_at": round(t_swap, 3), "unload_returned": round(t_unl, 3), "unload": u[:2],
                          "load_returned": round(t_load, 3), "load": l[:2]})
    seen.sort()
    rec("TRAF responses (start,end,thread,weights)", seen)
    last_s1_start = max([x[0] for x in seen if x[3] == "s1"], default=None)
    first_s2_start = min([x[0] for x in seen if x[3] == "s2"], default=None)
    rec("TRAF summary", {"n": len(seen), "s1": sum(x[3] == "s1" for x in seen), "s2": sum(x[3] == "s2" for x in seen),
                         "errors": [x for x in seen if x[3] not in ("s1", "s2")],
                         "s1_after_first_s2_end": [x for x in seen if x[3] == "s1" and first_s2_start is not None and x[0] > min(y[1] for y in seen if y[3] == 's2')],
                         "last_s1_start": last_s1_start, "first_s2_start": first_s2_start})
    rec("models", models(s.url))
finally:
    rec("left", s.stop())
    json.dump(out, open("study5.json", "w"), indent=1, default=str)
