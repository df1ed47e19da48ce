"""Study harness: start/stop one real SGLang server, timed, with RSS."""
import json, os, signal, subprocess, sys, time, urllib.request, urllib.error

VENV = "/root/.cache/lorafleet/venv-sglang-0.5.23"
MODEL = "/root/.cache/lorafleet/tiny-model-67b3ef7b39ed"
A = "/tmp/sgl-study/adapters"

def argv(model, port, *, max_lora_rank=8, targets=("all",), max_loaded_loras=None,
         max_loras_per_batch=None, extra=()):
    a = [f"{VENV}/bin/python", "-m", "sglang.launch_server", "--model-path", model,
         "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny",
         "--enable-lora", "--max-lora-rank", str(max_lora_rank),
         "--lora-target-modules", *targets, "--lora-backend", "torch_native",
         "--max-total-tokens", "4096", "--disable-overlap-schedule",
         "--host", "127.0.0.1", "--port", str(port)]
    if max_loaded_loras is not None:
        a += ["--max-loaded-loras", str(max_loaded_loras)]
    if max_loras_per_batch is not None:
        a += ["--max-loras-per-batch", str(max_loras_per_batch)]
    return a + list(extra)

ENV = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

def http(method, url, body=None, timeout=60, raw=False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, hdr = r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, text, hdr = e.code, e.read().decode(), dict(e.headers)
    dt = (time.perf_counter() - t) * 1000
    if raw:
        return status, text, dt
    try:
        return status, json.loads(text), dt
    except Exception:
        return status, text, dt

def tree_rss_mb(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss=,comm="], capture_output=True, text=True).stdout
    procs = {}
    for line in out.splitlines():
        p, pp, rss, comm = line.split(None, 3)
        procs[int(p)] = (int(pp), int(rss), comm)
    tree, frontier = {pid}, [pid]
    while frontier:
        cur = frontier.pop()
        for p, (pp, _, _) in procs.items():
            if pp == cur and p not in tree:
                tree.add(p); frontier.append(p)
    per = {p: (procs[p][2], procs[p][1] // 1024) for p in tree if p in procs}
    return sum(v[1] for v in per.values()), per

class Server:
    def __init__(self, port=31000, log="server", model=MODEL, env=None, **kw):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.logpath = f"/tmp/sgl-study/logs/{log}.log"
        self.argv = argv(model, port, **kw)
        self.env = env or ENV
    def start(self, timeout=300):
        self.log = open(self.logpath, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited rc={self.proc.returncode}; see {self.logpath}")
            try:
                s, _, _ = http("GET", self.url + "/ready", timeout=2)
                if s == 200:
                    self.ready_s = time.perf_counter() - self.t0
                    return self.ready_s
            except Exception:
                pass
            time.sleep(0.25)
        raise TimeoutError("not ready")
    def rss(self):
        return tree_rss_mb(self.proc.pid)
    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()
        time.sleep(1)
        left = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return left
    def kill9(self):
        os.kill(self.proc.pid, signal.SIGKILL)
    def logtext(self):
        return open(self.logpath).read()

def gen(url, **body):
    return http("POST", url + "/generate", body)

def comp(url, **body):
    return http("POST", url + "/v1/completions", body)

def chat(url, **body):
    return http("POST", url + "/v1/chat/completions", body)

def load(url, name, path, **extra):
    return http("POST", url + "/load_lora_adapter", {"lora_name": name, "lora_path": path, **extra})

def unload(url, name):
    return http("POST", url + "/unload_lora_adapter", {"lora_name": name})
