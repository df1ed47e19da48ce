"""Asynchronous RL with lorafleet: the trainer publishes every step while rollouts keep going.

    .venv/bin/python examples/async_rl.py      # starts a local fleet of 2 reference engines

- Every publication keeps the newest K versions routable (``keep_versions=K``) and refuses pins
  and sessions more than S versions behind the newest (``max_staleness=S``).
- A rollout worker runs each episode in one session (``X-Session-ID``): every turn comes from the
  version the episode started on, and every response says which (its ``lorafleet`` tag).
- The trainer keeps only samples at most S versions old when it uses them (the off-policy bound).

With a real trainer, replace SkillTrainer with your model and LocalFleet with your fleet's URLs.
"""

from __future__ import annotations

import queue
import threading
import uuid

from openai import OpenAI

from lorafleet.fleet.config import FleetConfig
from lorafleet.fleet.local import LocalFleet
from lorafleet.fleet.skill import PROMPT, SkillTrainer, reward
from lorafleet.publisher import Publisher
from lorafleet.tinymodel import ensure_tiny_model

NAME, K, S, STEPS, TURNS = "policy", 3, 2, 8, 2


def rollout_worker(client: OpenAI, samples: queue.Queue, stop: threading.Event) -> None:
    """Episodes of TURNS turns, each in its own session; one sample per turn."""
    while not stop.is_set():
        session = {"X-Session-ID": uuid.uuid4().hex}
        for _ in range(TURNS):
            out = client.completions.create(
                model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_headers=session
            )
            version = out.model_extra["lorafleet"]["version"]  # who produced this sample
            samples.put((version, reward(out.choices[0].text)))


def main() -> None:
    with LocalFleet(FleetConfig.default(engines=2, data_dir=".lorafleet-async-example")) as fleet:
        trainer = SkillTrainer(ensure_tiny_model())
        client = OpenAI(base_url=fleet.router_url + "/v1", api_key=fleet.api_key or "none")
        samples: queue.Queue = queue.Queue()
        stop = threading.Event()
        with Publisher(fleet.agent_urls, router=fleet.router_url, token=fleet.token) as pub:
            newest = pub.publish(trainer.model, name=NAME, keep_versions=K, max_staleness=S)
            worker = threading.Thread(target=rollout_worker, args=(client, samples, stop))
            worker.start()
            try:
                for step in range(1, STEPS + 1):
                    batch = []
                    while not samples.empty():
                        batch.append(samples.get())
                    fresh = [(v, r) for v, r in batch if newest.version - v <= S]
                    loss = trainer.train_step()  # a real trainer would learn from ``fresh``
                    newest = pub.publish(trainer.model, name=NAME, keep_versions=K, max_staleness=S)
                    print(
                        f"step {step}: used {len(fresh)}/{len(batch)} samples, loss {loss:.3f}, "
                        f"published v{newest.version}, routable {newest.routable_versions}"
                    )
            finally:
                stop.set()
                worker.join()


if __name__ == "__main__":
    main()
