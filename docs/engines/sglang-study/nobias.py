import json, os, shutil, sys
sys.path.insert(0, "/work/main/src")
from safetensors.torch import load_file, save_file
from lorafleet.testing import merged_greedy_ids
src, dst = "adapters/lorabias", "adapters_extra/lorabias_nobias"
shutil.rmtree(dst, ignore_errors=True); os.makedirs(dst)
sd = {k: v for k, v in load_file(f"{src}/adapter_model.safetensors").items() if not k.endswith("lora_B.bias")}
save_file(sd, f"{dst}/adapter_model.safetensors")
c = json.load(open(f"{src}/adapter_config.json")); c["lora_bias"] = False
json.dump(c, open(f"{dst}/adapter_config.json", "w"))
ref = json.load(open("ref.json"))
print(merged_greedy_ids(ref["base"], dst, "The quick brown fox", 8))
