import json, sys, torch
sys.path.insert(0, "/work/main/src")
from lorafleet.testing import merged_greedy_ids
from transformers import AutoTokenizer, AutoModelForCausalLM
from peft import PeftModel
ref = json.load(open("ref.json")); base = ref["base"]
tok = AutoTokenizer.from_pretrained(base)
chat = tok.apply_chat_template([{"role": "user", "content": "The quick brown fox"}], tokenize=False, add_generation_prompt=True)
ref["chat_prompt"] = chat
ref["chat_prompt_ids"] = tok(chat).input_ids
ref["chat_ids"] = {n: merged_greedy_ids(base, None if n == "base" else f"adapters/{n}", chat, 8) for n in ["base", "qkvo_s1", "all_s3", "qkvo_s2"]}
# unmerged references (PEFT forward), for adapters that cannot merge
def unmerged(n, prompt):
    m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    m = PeftModel.from_pretrained(m, f"adapters/{n}").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0][ids.shape[1]:].tolist()
ref["unmerged"] = {n: {p: unmerged(n, p) for p in ref["prompts"]} for n in ["lorabias", "mts", "dora", "qkvo_s1"]}
json.dump(ref, open("ref.json", "w"), indent=1)
print(chat, ref["chat_prompt_ids"], ref["chat_ids"], ref["unmerged"])
