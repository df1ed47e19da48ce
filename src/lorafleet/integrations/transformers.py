"""``LorafleetCallback``: publish a PEFT adapter from a ``transformers.Trainer`` (TRL included).

::

    with Publisher(agents=[...], router=router_url, token=token) as publisher:
        trainer = Trainer(model=peft_model, ..., callbacks=[LorafleetCallback(publisher, "policy")])
        trainer.train()

The adapter is published from memory (the PeftModel itself; nothing is written to the trainer's
disk) every ``every_n_steps`` optimizer steps and once more at the end of training. Each publish
adds ``lorafleet/publish_latency_s`` and ``lorafleet/version`` to the trainer's logs: the callback
asks the trainer to log at that step and adds both values to that log entry (``state.log_history``).
Reporters (W&B, TensorBoard) registered *before* this callback see the entry before it is extended;
put this callback first (``trainer.callback_handler.callbacks.insert(0, cb)``) if they need it.

A failed publish raises (``lorafleet.errors.PublishError``) and stops training: rollouts must not
silently run against a stale adapter.

When the Trainer runs distributed (``torchrun``; DDP, FSDP1 or FSDP2 through accelerate), every
rank publishes collectively through ``lorafleet.integrations.distributed.publish``: create the
callback on every rank, with the ``Publisher`` on rank 0 and ``None`` on the others. Only the
adapter's tensors are gathered to rank 0, which publishes; every rank gets the same result (and
the same log values), or raises the same error.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from lorafleet.integrations import distributed

__all__ = ["LATENCY_KEY", "VERSION_KEY", "LorafleetCallback"]

LATENCY_KEY = "lorafleet/publish_latency_s"
VERSION_KEY = "lorafleet/version"


def _unwrap(model: Any) -> Any:
    """The PeftModel under DDP/FSDP1/accelerate/compile wrappers."""
    try:
        return distributed._peft_model(model)
    except TypeError:
        raise TypeError(
            f"LorafleetCallback needs a PEFT model, got {type(model).__name__} "
            "(wrap the model with peft.get_peft_model first)"
        ) from None


class LorafleetCallback(TrainerCallback):
    """Publish the trainer's PEFT adapter through ``publisher`` every N steps and at the end.

    Args:
        publisher: a ``lorafleet.publisher.Publisher`` (the caller owns and closes it). In a
            distributed run, on rank 0; ``None`` on the other ranks.
        name: the adapter name clients use as ``model=``.
        every_n_steps: publish when ``global_step`` is a multiple of this.
        mode: ``"atomic"`` (router alias flip) or ``"in_place"``.
        keep_versions: the retention window (atomic): rollouts that started on one of the
            newest ``keep_versions`` versions finish on it (asynchronous RL; see docs/async-rl.md).
        min_replicas: a quorum (a count or a fraction): training goes on once that many
            replicas hold each version; the others catch up from peers (docs/quorum.md).
        publish_kwargs: passed to every ``publisher.publish`` call (e.g. ``transfer=``,
            ``max_staleness=``).
    """

    def __init__(
        self,
        publisher: Any,
        name: str,
        every_n_steps: int = 1,
        mode: str = "atomic",
        keep_versions: int = 1,
        min_replicas: int | float | None = None,
        **publish_kwargs: Any,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        if keep_versions > 1:
            publish_kwargs["keep_versions"] = keep_versions
        if min_replicas is not None:
            publish_kwargs["min_replicas"] = min_replicas
        self.publisher = publisher
        self.name = name
        self.every_n_steps = every_n_steps
        self.mode = mode
        self.publish_kwargs = publish_kwargs
        self.results: list[Any] = []
        """Every ``PublishResult``, in order."""
        self._last_step: int | None = None
        self._pending: dict[str, float] | None = None

    def _publish(self, model: Any, step: int) -> dict[str, float]:
        t = time.perf_counter()
        if distributed.is_distributed():
            # Collective: every rank gathers its shards of the adapter; rank 0 publishes.
            result = distributed.publish(
                model, self.publisher, name=self.name, mode=self.mode, **self.publish_kwargs
            )
        else:
            result = self.publisher.publish(
                _unwrap(model), name=self.name, mode=self.mode, **self.publish_kwargs
            )
        latency = time.perf_counter() - t
        self.results.append(result)
        self._last_step = step
        return {LATENCY_KEY: latency, VERSION_KEY: result.version}

    @staticmethod
    def _takes_part(state: Any) -> bool:
        """Distributed: every rank (the publish is collective). Otherwise: the main process."""
        return distributed.is_distributed() or state.is_world_process_zero

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> Any:
        if state.global_step % self.every_n_steps or not self._takes_part(state):
            return control
        self._pending = self._publish(model, state.global_step)
        control.should_log = True  # the trainer logs this step; on_log adds our values
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if self._pending is None:
            return control
        if logs is not None:
            logs.update(self._pending)
        # The trainer appended its entry before calling us; extend that entry in place.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        else:
            state.log_history.append({**self._pending, "step": state.global_step})
        self._pending = None
        return control

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> Any:
        if not self._takes_part(state) or self._last_step == state.global_step:
            return control  # the last step was already published: same weights
        values = self._publish(model, state.global_step)
        # Training is over, so no on_log follows; record the final publish directly.
        state.log_history.append({**values, "step": state.global_step})
        return control
