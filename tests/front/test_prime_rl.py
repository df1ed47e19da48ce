"""A prime-rl-style loop: root ``/load_lora_adapter``, the same name every step, a Bearer header
on every call. Each step is the next lorafleet version and serves the new weights at once."""

from __future__ import annotations

import httpx

from lorafleet.testing import make_peft_adapter, merged_greedy_ids

PROMPT = "The quick brown fox"
TOKEN = "prime-rl-token"
ROUTER_KEY = "sk-router-key"


def test_in_place_name_three_steps(front_fleet, tiny_model):
    front = front_fleet(router_api_key=ROUTER_KEY, trainer_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    http = httpx.Client(base_url=front.url, headers=auth, timeout=120)
    for step in (1, 2, 3):
        # prime-rl writes every step to the same directory.
        adapter = make_peft_adapter(tiny_model, front.shared / "broadcast" / "policy", seed=step)
        want = merged_greedy_ids(tiny_model, adapter, PROMPT, 8)
        r = http.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        assert r.headers["X-Lorafleet-Adapter-Version"] == str(step)
        for _ in range(4):
            r = http.post(
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": PROMPT,
                    "max_tokens": 8,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "policy"
            assert body["lorafleet"]["version"] == step
            assert body["choices"][0]["token_ids"] == want
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids[1:] == ["policy"]

    # Without the token, or with another one, control is refused; nothing changes.
    body = {"lora_name": "policy", "lora_path": str(adapter)}
    r = httpx.post(f"{front.url}/load_lora_adapter", json=body)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
    wrong = {"Authorization": "Bearer x"}
    r = httpx.post(f"{front.url}/load_lora_adapter", json=body, headers=wrong)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
    # The router's key is the front's to send: the router itself refuses a bare request.
    bare = {"model": "policy", "prompt": "a"}
    r = httpx.post(f"{front.fleet.router.url}/v1/completions", json=bare)
    assert r.status_code == 401
