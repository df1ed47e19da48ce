import json, sys
sys.path.insert(0, "/work/main/src")
from lorafleet.testing import make_peft_adapter, merged_greedy_ids, DEFAULT_TARGETS, ALL_LINEAR
import subprocess
base = subprocess.check_output(["/work/main/.venv/bin/lorafleet", "tiny-model", "--cached"], text=True).strip()
A = "/tmp/sgl-study/adapters"
specs = {
    "qkvo_s1": dict(r=8, seed=1, target_modules=DEFAULT_TARGETS),
    "qkvo_s2": dict(r=8, seed=2, target_modules=DEFAULT_TARGETS),
    "all_s3": dict(r=8, seed=3, target_modules=ALL_LINEAR),
    "qkvo_r16": dict(r=16, seed=4, target_modules=DEFAULT_TARGETS),
    "mts": dict(r=8, seed=5, target_modules=DEFAULT_TARGETS, modules_to_save=["lm_head"]),
    "dora": dict(r=8, seed=6, target_modules=DEFAULT_TARGETS, use_dora=True),
    "bias": dict(r=8, seed=7, target_modules=DEFAULT_TARGETS, bias="lora_only"),
    "lorabias": dict(r=8, seed=8, target_modules=DEFAULT_TARGETS, lora_bias=True),
    "gateup": dict(r=8, seed=9, target_modules=("gate_proj", "up_proj", "down_proj")),
}
prompts = ["The quick brown fox", "Q: hello"]
ref = {"base": base, "prompts": prompts, "ids": {}}
ref["ids"]["base"] = {p: merged_greedy_ids(base, None, p, 8) for p in prompts}
for name, kw in specs.items():
    d = make_peft_adapter(base, f"{A}/{name}", **kw)
    try:
        ref["ids"][name] = {p: merged_greedy_ids(base, d, p, 8) for p in prompts}
    except Exception as e:
        ref["ids"][name] = repr(e)
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(base)
ref["prompt_ids"] = {p: tok(p).input_ids for p in prompts}
json.dump(ref, open("/tmp/sgl-study/ref.json", "w"), indent=1)
print(json.dumps(ref, indent=1))
