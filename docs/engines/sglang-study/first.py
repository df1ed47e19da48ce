import json, sys, time
from sgl import *
s = Server(log="first")
try:
    print("ready_s", round(s.start(), 1))
    time.sleep(2)
    tot, per = s.rss(); print("rss_mb", tot, per)
    print(load(s.url, "a1", f"{A}/qkvo_s1"))
    print(gen(s.url, input_ids=[285,482,491,430], sampling_params={"temperature":0,"max_new_tokens":8}, lora_path="a1"))
    print(gen(s.url, input_ids=[285,482,491,430], sampling_params={"temperature":0,"max_new_tokens":8}))
    tot, per = s.rss(); print("rss_mb", tot, per)
finally:
    print("left", s.stop())
