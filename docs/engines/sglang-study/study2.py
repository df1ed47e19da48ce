"""S1 config again: chat addressing fix-up, lifecycle, in-place, limits."""
import os, shutil, threading
from common import *

s = Server(log="study2")
try:
    rec("ready_s", round(s.start(), 1)); rec("loadavg", open("/proc/loadavg").read())
    for ep in ["/ready", "/health", "/health_generate"]:
        rec(f"GET {ep}", http("GET", s.url + ep, raw=True))
    rec("load q1", load(s.url, "q1", f"{A}/qkvo_s1"))
    # ---- chat addressing, by response_token_ids; chat stream by text
    ch = {}
    for label, kw in [("bare", dict(model="q1")), ("tiny:q1", dict(model="tiny:q1")),
                      ("lora_path", dict(model="tiny", lora_path="q1")), ("base", dict(model="tiny")),
                      ("nosuch", dict(model="nosuch")), ("policy:q1", dict(model="policy:q1"))]:
        st, b, _ = chat(s.url, messages=[{"role": "user", "content": P}], max_tokens=8, temperature=0,
                        return_token_ids=True, **kw)
        ids = b["choices"][0].get("response_token_ids") if st == 200 else None
        text_ns = b["choices"][0]["message"]["content"] if st == 200 else None
        st2, text, _ = sse(s.url + "/v1/chat/completions", dict(messages=[{"role": "user", "content": P}],
                           max_tokens=8, temperature=0, stream=True, **kw))
        parts, mods = [], set()
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                j = json.loads(line[6:]); mods.add(j.get("model"))
                for c in j.get("choices", []):
                    parts.append(c.get("delta", {}).get("content") or "")
        ch[label] = {"status": st, "model": b.get("model"), "applied": who(ids, chat=True),
                     "stream_status": st2, "stream_models": sorted(map(str, mods)),
                     "stream_text_equals_nonstream": "".join(parts) == text_ns}
        if label == "tiny:q1":
            rec("chat stream raw tiny:q1", text)
    rec("chat matrix", ch)
    # chat with return_prompt_token_ids etc
    st, b, _ = chat(s.url, model="tiny:q1", messages=[{"role": "user", "content": P}], max_tokens=2, temperature=0,
                    return_prompt_token_ids=True, return_output_ids_in_sglext=True)
    rec("chat sglext ids", (st, b))
    # /generate with lora_path = a filesystem path
    rec("generate lora_path=<path>", g(s.url, f"{A}/qkvo_s1"))
    # ---- load/unload errors
    rec("load q1 again same path", load(s.url, "q1", f"{A}/qkvo_s1"))
    rec("load q1 again other path", load(s.url, "q1", f"{A}/qkvo_s2"))
    rec("load missing path", load(s.url, "m1", "/tmp/sgl-study/nope"))
    os.makedirs("/tmp/sgl-study/emptydir", exist_ok=True)
    rec("load dir without adapter_config.json", load(s.url, "m2", "/tmp/sgl-study/emptydir"))
    shutil.rmtree("/tmp/sgl-study/noweights", ignore_errors=True); os.makedirs("/tmp/sgl-study/noweights")
    shutil.copy(f"{A}/qkvo_s1/adapter_config.json", "/tmp/sgl-study/noweights/")
    rec("load dir without weights", load(s.url, "m3", "/tmp/sgl-study/noweights"))
    shutil.rmtree("/tmp/sgl-study/badweights", ignore_errors=True); shutil.copytree(f"{A}/qkvo_s1", "/tmp/sgl-study/badweights")
    open("/tmp/sgl-study/badweights/adapter_model.safetensors", "wb").write(b"garbage" * 10)
    rec("load corrupt safetensors", load(s.url, "m4", "/tmp/sgl-study/badweights"))
    rec("models after failed loads", models(s.url))
    rec("generate m3 after failed load", g(s.url, "m3"))
    rec("load with unknown field foo", load(s.url, "f1", f"{A}/qkvo_s2", foo=1))
    rec("load new name upsert:true", load(s.url, "u1", f"{A}/qkvo_s2", upsert=True))
    rec("load existing name upsert:true", load(s.url, "u1", f"{A}/qkvo_s1", upsert=True))
    rec("generate u1", g(s.url, "u1"))
    rec("load with lora_id given", load(s.url, "i1", f"{A}/qkvo_s2", lora_id="myid"))
    rec("unload unknown", unload(s.url, "nosuch"))
    rec("unload f1", unload(s.url, "f1"))
    rec("unload f1 again", unload(s.url, "f1"))
    rec("load_lora_adapter missing lora_path", http("POST", s.url + "/load_lora_adapter", {"lora_name": "x"}))
    rec("/v1/load_lora_adapter", http("POST", s.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": f"{A}/qkvo_s1"}))
    for n in ["u1", "i1"]:
        unload(s.url, n)
    # ---- in-place
    rec("IP1 load A<-s1", load(s.url, "A", f"{A}/qkvo_s1"))
    rec("IP1 gen A", g(s.url, "A")); rec("IP1 gen A again", g(s.url, "A"))
    rec("IP1 unload A", unload(s.url, "A"))
    rec("IP1 models after unload", models(s.url))
    rec("IP1 load A<-s2", load(s.url, "A", f"{A}/qkvo_s2"))
    rec("IP1 gen A (first after reload)", g(s.url, "A"))
    rec("IP1 completions tiny:A", (lambda r: (r[0], who(r[1]["choices"][0]["token_ids"]) if r[0] == 200 else r[1]))(
        comp(s.url, model="tiny:A", prompt=PIDS, max_tokens=8, temperature=0, return_token_ids=True)))
    rec("IP2 unload A", unload(s.url, "A"))
    rec("IP2 gen A after unload (implicit reload?)", g(s.url, "A"))
    rec("IP2 completions tiny:A after unload", (lambda r: (r[0], who(r[1]["choices"][0]["token_ids"]) if r[0] == 200 else r[1]))(
        comp(s.url, model="tiny:A", prompt=PIDS, max_tokens=8, temperature=0, return_token_ids=True)))
    rec("IP2 models after implicit reload", models(s.url))
    rec("IP2 load A<-s1 after implicit reload", load(s.url, "A", f"{A}/qkvo_s1"))
    rec("IP2 gen A", g(s.url, "A"))
    # loop: unload; load; succeed?
    rec("IP3 unload A", unload(s.url, "A"))
    rec("IP3 load A<-s1", load(s.url, "A", f"{A}/qkvo_s1"))
    rec("IP3 gen A", g(s.url, "A"))
    # same path, files changed underneath
    M = "/tmp/sgl-study/mut"; shutil.rmtree(M, ignore_errors=True); shutil.copytree(f"{A}/qkvo_s1", M)
    rec("IP4 load M<-mut(s1)", load(s.url, "M", M)); rec("IP4 gen M", g(s.url, "M"))
    shutil.copy(f"{A}/qkvo_s2/adapter_model.safetensors", f"{M}/adapter_model.safetensors")
    rec("IP4 gen M after files replaced (no reload)", g(s.url, "M"))
    rec("IP4 unload M", unload(s.url, "M"))
    rec("IP4 gen M implicit reload from changed files", g(s.url, "M"))
    rec("IP4 unload M 2", unload(s.url, "M"))
    rec("IP4 load M<-mut(s2 now)", load(s.url, "M", M)); rec("IP4 gen M", g(s.url, "M"))
    # files removed after unload
    R = "/tmp/sgl-study/gone"; shutil.rmtree(R, ignore_errors=True); shutil.copytree(f"{A}/qkvo_s1", R)
    rec("IP5 load R", load(s.url, "R", R)); rec("IP5 unload R", unload(s.url, "R"))
    shutil.rmtree(R)
    rec("IP5 gen R (files gone)", g(s.url, "R"))
    rec("IP5 completions tiny:R (files gone)", comp(s.url, model="tiny:R", prompt=PIDS, max_tokens=2, temperature=0))
    rec("IP5 models", models(s.url))
    rec("IP5 load R<-s2", load(s.url, "R", f"{A}/qkvo_s2")); rec("IP5 gen R", g(s.url, "R"))
    rec("IP5 health after", http("GET", s.url + "/health_generate"))
    # registered adapter whose files vanish: is the adapter in memory? (no eviction here)
    R2 = "/tmp/sgl-study/gone2"; shutil.rmtree(R2, ignore_errors=True); shutil.copytree(f"{A}/qkvo_s1", R2)
    rec("IP5b load R2", load(s.url, "R2", R2)); shutil.rmtree(R2)
    rec("IP5b gen R2 (files gone, still registered)", g(s.url, "R2"))
    # ---- unload during in-flight
    res = {}
    def long_gen():
        t = time.perf_counter()
        res["long"] = g(s.url, "A", n=400, **{})
        res["long_t"] = (time.perf_counter() - t, time.perf_counter())
    def long_gen_ignore_eos():
        t = time.perf_counter()
        body = dict(input_ids=PIDS, sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}, lora_path="A")
        st, b, dt = gen(s.url, **body)
        res["long"] = (st, b["output_ids"][:8] if st == 200 else b, len(b.get("output_ids", [])) if st == 200 else None)
        res["long_end"] = time.perf_counter()
    th = threading.Thread(target=long_gen_ignore_eos); t0 = time.perf_counter(); th.start(); time.sleep(0.5)
    res3 = {}
    def late_req():
        time.sleep(0.3)
        t = time.perf_counter(); res3["late"] = g(s.url, "A"); res3["late_end"] = time.perf_counter()
    th2 = threading.Thread(target=late_req); th2.start()
    tu = time.perf_counter(); r = unload(s.url, "A"); tu_end = time.perf_counter()
    th.join(); th2.join()
    rec("IP6 unload during in-flight", {"unload": r, "unload_started_s": round(tu - t0, 2), "unload_returned_s": round(tu_end - t0, 2),
        "long_gen_ended_s": round(res["long_end"] - t0, 2), "long": res["long"],
        "late_req_ended_s": round(res3["late_end"] - t0, 2), "late": res3["late"]})
    rec("IP6 models", models(s.url))
    # ---- limits (targets all, rank 8)
    for n in ["qkvo_r16", "mts", "dora", "bias", "lorabias", "gateup"]:
        r = load(s.url, n, f"{A}/{n}")
        rec(f"LIM load {n}", r)
        if r[0] == 200:
            rec(f"LIM gen {n}", g(s.url, n))
    rec("models end", models(s.url))
    rec("rss_end", s.rss())
finally:
    rec("left", s.stop())
    json.dump(out, open("study2.json", "w"), indent=1, default=str)
