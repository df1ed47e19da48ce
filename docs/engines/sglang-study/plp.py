import json, sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
ref = json.load(open("ref.json")); base = ref["base"]
ids = torch.tensor([ref["prompt_ids"]["The quick brown fox"]])
def lp(adapter):
    m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter: m = PeftModel.from_pretrained(m, adapter)
    m.eval()
    with torch.no_grad():
        logits = m(ids).logits[0].log_softmax(-1)
    return [logits[i, ids[0, i + 1]].item() for i in range(ids.shape[1] - 1)] + [logits[-1].max().item()]
ref["prompt_logprobs"] = {"base": lp(None), "qkvo_s1": lp("adapters/qkvo_s1"), "qkvo_s2": lp("adapters/qkvo_s2")}
json.dump(ref, open("ref.json", "w"), indent=1)
print(ref["prompt_logprobs"])
