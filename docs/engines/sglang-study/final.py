"""Smoke with the documented argv function and the final shim: start, LoRA both addressings, PEFT equality, stop."""
import os, signal, subprocess
from common import *
ns = {}; exec(open("/tmp/sgl-study/launch_fn.py").read(), ns)
argv = ns["sglang_argv"](f"{VENV}/bin/python", MODEL, 31000)
env = dict(os.environ, **ns["SGLANG_ENV"])
rec("argv", argv)
t0 = time.perf_counter()
proc = subprocess.Popen(argv, env=env, stdout=open("logs/final.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
url = "http://127.0.0.1:31000"
try:
    while True:
        assert proc.poll() is None
        try:
            if http("GET", url + "/ready", timeout=2)[0] == 200: break
        except Exception: pass
        time.sleep(0.25)
    rec("ready_s", round(time.perf_counter() - t0, 1)); rec("loadavg", open("/proc/loadavg").read())
    rec("rss", tree_rss_mb(proc.pid))
    rec("load q1", load(url, "q1", f"{A}/qkvo_s1")[0]); rec("load al3", load(url, "al3", f"{A}/all_s3")[0])
    rec("load r16", load(url, "r16", f"{A}/qkvo_r16")[0])
    rec("gen q1", g(url, "q1")); rec("gen al3", g(url, "al3")); rec("gen r16", g(url, "r16")); rec("gen base", g(url, None))
    st, b, _ = comp(url, model="tiny:al3", prompt=P, max_tokens=8, temperature=0, return_token_ids=True)
    rec("completions tiny:al3", (st, who(b["choices"][0]["token_ids"])))
    st, b, _ = comp(url, model="al3", prompt=P, max_tokens=8, temperature=0, return_token_ids=True)
    rec("completions bare al3", (st, who(b["choices"][0]["token_ids"])))
finally:
    proc.send_signal(signal.SIGTERM); proc.wait(60); time.sleep(1)
    rec("sglang:: left", subprocess.run(["pgrep", "-a", "-f", "sglang::"], capture_output=True, text=True).stdout)
