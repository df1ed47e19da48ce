import json, os, sys, torch
sys.path.insert(0, "/work/main/src")
from lorafleet.testing import make_peft_model, DEFAULT_TARGETS
from transformers import AutoTokenizer
ref = json.load(open("ref.json")); base = ref["base"]
tok = AutoTokenizer.from_pretrained(base)
ids = tok("The quick brown fox", return_tensors="pt").input_ids
res = {}
for name, kw, perturb in [
    ("mts_lm", dict(modules_to_save=["lm_head"]), "lm_head"),
    ("mts_emb", dict(modules_to_save=["embed_tokens"]), "embed_tokens"),
    ("lora_lmhead", dict(target_modules=(*DEFAULT_TARGETS, "lm_head")), None),
    ("lora_emb", dict(target_modules=(*DEFAULT_TARGETS, "embed_tokens")), None),
]:
    kw.setdefault("target_modules", DEFAULT_TARGETS)
    m = make_peft_model(base, r=8, seed=11, **kw)
    if perturb:
        torch.manual_seed(5)
        for n, p in m.named_parameters():
            if "modules_to_save" in n and perturb in n:
                with torch.no_grad():
                    p.add_(torch.randn_like(p) * 0.5)
    m.eval()
    with torch.no_grad():
        out = m.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    res[name] = out[0][ids.shape[1]:].tolist()
    m.save_pretrained(f"adapters_extra/{name}")
ref.setdefault("unmerged", {})
for k, v in res.items():
    ref["unmerged"][k] = {"The quick brown fox": v}
json.dump(ref, open("ref.json", "w"), indent=1)
print(res)
