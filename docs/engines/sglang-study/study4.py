"""modules_to_save / lm_head / embed adapters under 'all' and under q,k,v,o; api-key auth; misc."""
import os, subprocess
from common import *
E = "/tmp/sgl-study/adapters_extra"
def cpu_s(pid):
    tot = 0
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    pp = {int(a): int(b) for a, b in (l.split() for l in out.splitlines())}
    tree = {pid}; ch = True
    while ch:
        ch = False
        for p, q in pp.items():
            if q in tree and p not in tree: tree.add(p); ch = True
    for p in tree:
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            tot += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except Exception: pass
    return round(tot, 1)
def hk(method, url, body=None, key=None):
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data else {}
    if key: h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r: return r.status, r.read().decode()[:300]
    except urllib.error.HTTPError as e: return e.code, e.read().decode()[:300]

s_http = http
for cfg, kw in [("all+apikey", dict(targets=("all",), extra=("--skip-server-warmup", "--api-key", "sekret"))),
                ("qkvo", dict(targets=("q_proj", "k_proj", "v_proj", "o_proj"), extra=("--skip-server-warmup",)))]:
    s = Server(log=f"study4-{cfg}", **kw)
    try:
        rec(f"{cfg} ready_s", round(s.start(), 1)); rec(f"{cfg} cpu_s at ready", cpu_s(s.proc.pid)); rec("loadavg", open("/proc/loadavg").read())
        key = "sekret" if "apikey" in cfg else None
        if key:
            for ep, m, b in [("/ready", "GET", None), ("/health", "GET", None), ("/v1/models", "GET", None), ("/server_info", "GET", None),
                             ("/load_lora_adapter", "POST", {"lora_name": "k1", "lora_path": f"{A}/qkvo_s1"}),
                             ("/unload_lora_adapter", "POST", {"lora_name": "k1"}),
                             ("/generate", "POST", {"input_ids": PIDS, "sampling_params": {"max_new_tokens": 1}}),
                             ("/v1/completions", "POST", {"model": "tiny", "prompt": PIDS, "max_tokens": 1})]:
                rec(f"AUTH no key {m} {ep}", hk(m, s.url + ep, b))
            rec("AUTH with key load", hk("POST", s.url + "/load_lora_adapter", {"lora_name": "k1", "lora_path": f"{A}/qkvo_s1"}, key))
            rec("AUTH wrong key load", hk("POST", s.url + "/load_lora_adapter", {"lora_name": "k2", "lora_path": f"{A}/qkvo_s1"}, "nope"))
            rec("AUTH with key v1/models/tiny:k1", hk("GET", s.url + "/v1/models/tiny:k1", None, key))
            rec("AUTH with key v1/models/k1", hk("GET", s.url + "/v1/models/k1", None, key))
            rec("AUTH with key v1/models/nosuch", hk("GET", s.url + "/v1/models/nosuch", None, key))
            rec("AUTH with key unload", hk("POST", s.url + "/unload_lora_adapter", {"lora_name": "k1"}, key))
            s_http = http
            def http(method, url, body=None, timeout=60, raw=False, _k=key):  # noqa
                data = None if body is None else json.dumps(body).encode()
                h = {"Authorization": f"Bearer {_k}"}
                if data: h["Content-Type"] = "application/json"
                req = urllib.request.Request(url, data=data, method=method, headers=h)
                t = time.perf_counter()
                try:
                    with urllib.request.urlopen(req, timeout=timeout) as r: st, tx = r.status, r.read().decode()
                except urllib.error.HTTPError as e: st, tx = e.code, e.read().decode()
                try: return st, (tx if raw else json.loads(tx)), (time.perf_counter() - t) * 1000
                except Exception: return st, tx, 0
            import sgl, common
            sgl.http = http; common.http = http; common.gen = lambda url, **b: http("POST", url + "/generate", b)
            gen_ = common.gen
        else:
            import sgl, common
            sgl.http = s_http; common.http = s_http; common.gen = lambda url, **b: s_http("POST", url + "/generate", b)
        for n in ["mts_lm", "mts_emb", "lora_lmhead", "lora_emb"]:
            r = common.http("POST", s.url + "/load_lora_adapter", {"lora_name": n, "lora_path": f"{E}/{n}"})
            rec(f"{cfg} load {n}", r)
            if r[0] == 200:
                rec(f"{cfg} gen {n}", common.g(s.url, n))
        rec(f"{cfg} rss", s.rss())
        hp = [p for p, v in s.rss()[1].items() if v[1] < 100]
        for p in hp:
            rec(f"{cfg} small helper cmdline", open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:300])
    finally:
        rec(f"{cfg} left", s.stop())
json.dump(out, open("study4.json", "w"), indent=1, default=str)
