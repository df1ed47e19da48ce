import json, time, urllib.request, urllib.error
from sgl import *
REF = json.load(open("/tmp/sgl-study/ref.json"))
P = "The quick brown fox"
PIDS = REF["prompt_ids"][P]
out = {}
def rec(key, val):
    out[key] = val
    s = json.dumps(val, default=str)
    print(f"== {key}: {s[:2500]}", flush=True)
def who(ids, chat=False):
    if ids is None:
        return ["NO-IDS"]
    table = dict(REF["chat_ids"]) if chat else {k: v[P] for k, v in REF["ids"].items() if isinstance(v, dict)}
    if not chat:
        table.update({f"unmerged:{k}": v[P] for k, v in REF["unmerged"].items()})
    return [k for k, v in table.items() if v == ids] or [f"NONE{ids}"]
def g(url, name=None, n=8, **kw):
    body = dict(input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": n}, **kw)
    if name is not None:
        body["lora_path"] = name
    st, b, dt = gen(url, **body)
    if st == 200:
        return st, who(b["output_ids"]), b["meta_info"].get("cached_tokens"), round(dt, 1)
    return st, b, round(dt, 1)
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
def models(url):
    st, b, _ = http("GET", url + "/v1/models")
    return [(c["id"], c["root"], c["parent"]) for c in b["data"]]
