import os
from common import *
env = dict(ENV, PYTHONPATH="/tmp/sgl-study/modspy")
s = Server(log="spy", env=env, extra=("--skip-server-warmup",))
try:
    rec("ready", s.start())
    rec("load", load(s.url, "q1", f"{A}/qkvo_s1"))
    rec("g", g(s.url, "q1"))
    rec("comp", comp(s.url, model="tiny:q1", prompt=P, max_tokens=4, temperature=0, logprobs=2, echo=True)[0])
    rec("chat", chat(s.url, model="tiny:q1", messages=[{"role": "user", "content": P}], max_tokens=4)[0])
    rec("chat stream", sse(s.url + "/v1/chat/completions", dict(model="tiny:q1", messages=[{"role": "user", "content": P}], max_tokens=4, stream=True))[0])
    rec("gen stream", sse(s.url + "/generate", dict(text=P, sampling_params={"max_new_tokens": 4}, stream=True, lora_path="q1", return_logprob=True))[0])
    rec("json schema", comp(s.url, model="tiny", prompt=P, max_tokens=4, regex="[a-z]+")[0])
    rec("unload", unload(s.url, "q1")[0])
    rec("health", http("GET", s.url + "/health")[0])
    time.sleep(7)
finally:
    rec("left", s.stop())
