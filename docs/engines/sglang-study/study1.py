"""Server S1: targets all, rank 8. Info, addressing, probe, lifecycle, limits."""
import json, os, shutil, statistics, threading, time, urllib.request
from sgl import *

REF = json.load(open("ref.json"))
P = "The quick brown fox"
PIDS = REF["prompt_ids"][P]
out = {}
def rec(key, val):
    out[key] = val
    s = json.dumps(val, default=str)
    print(f"== {key}: {s[:1500]}", flush=True)

def who(ids, chat=False):
    """Name the reference these ids match."""
    table = REF["chat_ids"] if chat else {k: v[P] for k, v in REF["ids"].items() if isinstance(v, dict)}
    if not chat:
        table = {**table, **{f"unmerged:{k}": v[P] for k, v in REF["unmerged"].items()}}
    hits = [k for k, v in table.items() if v == ids]
    return hits or ["NONE"]

def sse(url, body, timeout=60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return status, text, (time.perf_counter() - t) * 1000

s = Server(log="study1")
try:
    rec("ready_s", round(s.start(), 1))
    time.sleep(1)
    rec("rss_idle", s.rss())
    # ---- info endpoints
    for ep in ["/health", "/health_generate", "/v1/models", "/get_model_info", "/model_info", "/server_info", "/get_server_info"]:
        st, body, dt = http("GET", s.url + ep, raw=True)
        if ep.endswith("server_info") and st == 200:
            j = json.loads(body)
            keys = {k: j.get(k) for k in ["served_model_name", "model_path", "max_lora_rank", "max_loras_per_batch",
                                          "max_loaded_loras", "lora_target_modules", "lora_backend", "lora_paths",
                                          "enable_lora", "lora_eviction_policy", "version", "max_total_num_tokens",
                                          "weight_version", "api_key", "admin_api_key"]}
            keys["_other_top_keys"] = [k for k in j if k not in keys][:0]
            keys["_has_internal_states"] = "internal_states" in j
            keys["_version_field"] = j.get("version")
            rec(f"GET {ep}", {"status": st, "ms": round(dt, 1), "lora_fields": keys, "len": len(body)})
        else:
            rec(f"GET {ep}", {"status": st, "ms": round(dt, 1), "body": body[:800]})
    # ---- loads
    rec("load q1", load(s.url, "q1", f"{A}/qkvo_s1"))
    rec("load al3", load(s.url, "al3", f"{A}/all_s3"))
    rec("GET /v1/models after load", http("GET", s.url + "/v1/models"))
    # ---- addressing matrix
    variants = {
        "bare": dict(model="{n}"),
        "tiny:name": dict(model="tiny:{n}"),
        "lora_path": dict(model="tiny", lora_path="{n}"),
        "tiny:nosuch": dict(model="tiny:nosuch"),
        "bare_unknown": dict(model="nosuch"),
        "other:name": dict(model="policy:{n}"),
        "tiny:name+lora_path_other": dict(model="tiny:{n}", lora_path="{o}"),
        "base": dict(model="tiny"),
        "bare+lora_path": dict(model="{n}", lora_path="{n}"),
    }
    def fill(d, n, o):
        return {k: v.format(n=n, o=o) for k, v in d.items()}
    matrix = {}
    for n, o in [("q1", "al3"), ("al3", "q1")]:
        for vname, v in variants.items():
            if n == "al3" and vname in ("tiny:nosuch", "bare_unknown", "base"):
                continue
            fv = fill(v, n, o)
            row = {}
            # completions, text prompt
            st, b, dt = comp(s.url, prompt=P, max_tokens=8, temperature=0, return_token_ids=True, **fv)
            row["completions_text"] = (st, b.get("model") if isinstance(b, dict) else None,
                                       who(b["choices"][0].get("token_ids")) if st == 200 else b)
            if n == "q1" and vname in ("tiny:name", "bare"):
                rec(f"completions body {vname}", b)
            # completions, token-id prompt
            st, b, dt = comp(s.url, prompt=PIDS, max_tokens=8, temperature=0, return_token_ids=True, **fv)
            row["completions_ids"] = (st, b.get("model") if isinstance(b, dict) else None,
                                      who(b["choices"][0].get("token_ids")) if st == 200 else b)
            # chat non-stream
            st, b, dt = chat(s.url, messages=[{"role": "user", "content": P}], max_tokens=8, temperature=0,
                             return_token_ids=True, **fv)
            if st == 200:
                ch = b["choices"][0]
                row["chat"] = (st, b.get("model"), who(ch.get("token_ids") or [], chat=True))
                if n == "q1" and vname == "tiny:name":
                    rec("chat body tiny:name", b)
            else:
                row["chat"] = (st, None, b)
            # chat stream
            body = dict(messages=[{"role": "user", "content": P}], max_tokens=8, temperature=0, stream=True,
                        return_token_ids=True, **fv)
            st, text, dt = sse(s.url + "/v1/chat/completions", body)
            if n == "q1" and vname == "tiny:name":
                rec("chat stream raw tiny:name", text)
            ids, models = [], set()
            if st == 200:
                for line in text.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        j = json.loads(line[6:])
                        models.add(j.get("model"))
                        for c in j.get("choices", []):
                            ids += c.get("token_ids") or []
                row["chat_stream"] = (st, sorted(map(str, models)), who(ids, chat=True))
            else:
                row["chat_stream"] = (st, None, text[:400])
            # completions stream
            body = dict(prompt=P, max_tokens=8, temperature=0, stream=True, return_token_ids=True, **fv)
            st, text, dt = sse(s.url + "/v1/completions", body)
            if n == "q1" and vname == "tiny:name":
                rec("completions stream raw tiny:name", text)
            ids, models = [], set()
            if st == 200:
                for line in text.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        j = json.loads(line[6:])
                        models.add(j.get("model"))
                        for c in j.get("choices", []):
                            ids += c.get("token_ids") or []
                row["completions_stream"] = (st, sorted(map(str, models)), who(ids))
            else:
                row["completions_stream"] = (st, None, text[:400])
            matrix[f"{n}/{vname}"] = row
            print(f"-- {n}/{vname} {fv}: {json.dumps(row)[:1200]}", flush=True)
    rec("matrix", matrix)
    # ---- /generate
    g = {}
    sp = {"temperature": 0, "max_new_tokens": 8}
    for label, extra in [("lora_path=q1", dict(lora_path="q1")), ("no lora", {}),
                         ("lora_path=tiny:q1", dict(lora_path="tiny:q1")),
                         ("lora_path=nosuch", dict(lora_path="nosuch")),
                         ("model=q1 (ignored?)", dict(model="q1")),
                         ("model=tiny:q1", dict(model="tiny:q1")),
                         ("lora_path=null", dict(lora_path=None))]:
        for inp in ("text", "input_ids"):
            body = dict(text=P) if inp == "text" else dict(input_ids=PIDS)
            st, b, dt = gen(s.url, sampling_params=sp, **body, **extra)
            g[f"{label}/{inp}"] = (st, who(b["output_ids"]) if st == 200 and isinstance(b, dict) else b)
    rec("generate", g)
    st, b, dt = gen(s.url, input_ids=PIDS, sampling_params=sp, lora_path="q1")
    rec("generate body input_ids", b)
    st, text, dt = sse(s.url + "/generate", dict(input_ids=PIDS, sampling_params=sp, lora_path="q1", stream=True))
    rec("generate stream raw", {"status": st, "text": text})
    # batched with mixed adapters
    st, b, dt = gen(s.url, input_ids=[PIDS, PIDS, PIDS], sampling_params=sp, lora_path=["q1", "al3", None])
    rec("generate batch mixed", (st, [who(x["output_ids"]) for x in b] if st == 200 else b))
    # ---- logprobs / probe
    for mnt in (0, 1):
        st, b, dt = gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": mnt},
                        lora_path="q1", return_logprob=True, logprob_start_len=0)
        rec(f"generate logprob mnt={mnt}", {"status": st, "ms": round(dt, 1), "body": b})
    st, b, dt = comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=1, temperature=0, echo=True, logprobs=1)
    rec("completions echo+logprobs max_tokens=1", {"status": st, "body": b})
    st, b, dt = comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=0, temperature=0)
    rec("completions max_tokens=0", {"status": st, "body": b})
    st, b, dt = comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=1, temperature=0, logprobs=1, return_token_ids=True)
    rec("completions logprobs=1 max_tokens=1", {"status": st, "body": b})
    # probe latency
    def lat(fn, k=20):
        xs = []
        for _ in range(k):
            t = time.perf_counter(); r = fn(); xs.append((time.perf_counter() - t) * 1000)
            assert r[0] == 200, r
        return {"median_ms": round(statistics.median(xs), 1), "p90_ms": round(sorted(xs)[int(0.9 * len(xs))], 1), "min_ms": round(min(xs), 1)}
    probes = {
        "generate lp mnt=1 adapter": lambda: gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 1}, lora_path="q1", return_logprob=True, logprob_start_len=0),
        "generate lp mnt=1 base": lambda: gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0),
        "generate greedy 4 adapter": lambda: gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 4}, lora_path="q1"),
        "generate greedy 1 adapter": lambda: gen(s.url, input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 1}, lora_path="q1"),
        "completions tiny:q1 max_tokens=1": lambda: comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=1, temperature=0, return_token_ids=True),
        "completions tiny:q1 max_tokens=4": lambda: comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=4, temperature=0, return_token_ids=True),
        "completions tiny:q1 max_tokens=1 logprobs=5": lambda: comp(s.url, model="tiny:q1", prompt=PIDS, max_tokens=1, temperature=0, logprobs=5),
        "load+unload cycle": lambda: (load(s.url, "tmp", f"{A}/qkvo_s2"), unload(s.url, "tmp"))[1],
    }
    rec("probe latency", {k: lat(f) for k, f in probes.items()})
    rec("rss_after_traffic", s.rss())
finally:
    rec("left", s.stop())
    json.dump(out, open("study1.json", "w"), indent=1, default=str)
