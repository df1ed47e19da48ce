"""One rank of a ``torchrun --nproc-per-node 2`` job for tests/integrations/test_distributed.py.

Not collected by pytest. Each rank writes ``<out>/rank<N>.json``: what each publication returned
or raised on this rank, and which tensors were materialised while it ran. The fleet comes from
the environment (``LORAFLEET_TEST_AGENTS``, ``LORAFLEET_TEST_ROUTER``, ``LORAFLEET_TEST_TOKEN``).

    torchrun --nproc-per-node 2 ... dist_worker.py --wrap fsdp2 --out DIR --name NAME
    torchrun --nproc-per-node 2 ... dist_worker.py --trainer --out DIR --name NAME

Instrumentation, independent of the code under test: ``DTensor.full_tensor`` (how FSDP2/DTensor
parameters are materialised), FSDP2's ``FSDPParamGroup.unshard`` and FSDP1's
``FlatParamHandle.unshard`` (how FSDP materialises whole units) are wrapped to record the
names of what they materialise, only while a publication runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

R_OK = 8
R_REFUSED = 32  # above the fleet's max LoRA rank: the replicas refuse it


def _peft(model: Any) -> Any:
    from lorafleet.integrations.distributed import _peft_model

    return _peft_model(model)


@contextlib.contextmanager
def record_materialised(model: Any):
    """Yield a dict that fills with what gets materialised: names and element counts."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    peft_model = _peft(model)
    names = {id(p): n for n, p in peft_model.named_parameters(remove_duplicate=False)}
    flat_owner = {}
    for mod_name, mod in peft_model.named_modules():
        handle = getattr(mod, "_handle", None)
        if handle is not None and getattr(handle, "flat_param", None) is not None:
            flat_owner[id(handle)] = (mod_name, list(handle.flat_param._fqns))
    seen: dict[str, Any] = {
        "full_tensor": [],
        "to_local": [],
        "gather_numel": 0,
        "fsdp2_unshard": 0,
        "fsdp1_unshard": [],
    }
    orig_full, orig_local, orig_gather, orig_group, orig_handle = (
        DTensor.full_tensor,
        DTensor.to_local,
        dist.gather,
        FSDPParamGroup.unshard,
        FlatParamHandle.unshard,
    )

    def full_tensor(self, *a, **kw):
        out = orig_full(self, *a, **kw)
        seen["full_tensor"].append([names.get(id(self), "<not a parameter>"), out.numel()])
        return out

    def to_local(self, *a, **kw):
        seen["to_local"].append(names.get(id(self), "<not a parameter>"))
        return orig_local(self, *a, **kw)

    def gather(tensor, *a, **kw):
        seen["gather_numel"] += tensor.numel()
        return orig_gather(tensor, *a, **kw)

    def group_unshard(self, *a, **kw):
        seen["fsdp2_unshard"] += 1
        return orig_group(self, *a, **kw)

    def handle_unshard(self, *a, **kw):
        path, fqns = flat_owner.get(id(self), ("<unknown>", []))
        seen["fsdp1_unshard"].append([path, fqns, self.flat_param._unpadded_unsharded_size.numel()])
        return orig_handle(self, *a, **kw)

    DTensor.full_tensor, DTensor.to_local, dist.gather = full_tensor, to_local, gather
    FSDPParamGroup.unshard, FlatParamHandle.unshard = group_unshard, handle_unshard
    try:
        yield seen
    finally:
        DTensor.full_tensor, DTensor.to_local, dist.gather = orig_full, orig_local, orig_gather
        FSDPParamGroup.unshard, FlatParamHandle.unshard = orig_group, orig_handle


def build(base: Path, wrap: str, r: int) -> Any:
    """The tiny model with a random LoRA of rank ``r`` (same seed on every rank), wrapped."""
    from lorafleet.testing import make_peft_model

    model = make_peft_model(base, r=r, seed=r)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif wrap == "fsdp1":
        from peft.utils.other import fsdp_auto_wrap_policy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(
            model, auto_wrap_policy=fsdp_auto_wrap_policy(model), device_id=torch.device("cpu")
        )
    elif wrap == "fsdp1-mixed":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # One unit for the whole model: LoRA weights share a flat parameter with base weights.
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    elif wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def train_step(model: Any) -> None:
    """One optimizer step on the LoRA parameters, so that what is published has been trained."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    ids = torch.arange(2, 18).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def save_reference(model: Any, wrap: str, base: Path, r: int, out: Path, rank: int) -> None:
    """Write the adapter with torch's and PEFT's own tools (not lorafleet's) for the test.

    Collective for FSDP: torch's full state dict of the whole model, loaded into an unsharded
    PEFT model on rank 0 and saved with ``save_pretrained``.
    """
    from lorafleet.testing import make_peft_model

    if wrap == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(
            model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False)
        ):
            full = model.state_dict()
    else:
        full = _peft(model).state_dict()
    if rank == 0:
        plain = make_peft_model(base, r=r, seed=r)
        missing, unexpected = plain.load_state_dict(full, strict=False)
        assert not unexpected and not [k for k in missing if "lora_" in k], (missing, unexpected)
        plain.save_pretrained(str(out))


def attempt(fn, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one publication on this rank; record its result or its error."""
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "failures": getattr(exc, "failures", None),
            "trace": traceback.format_exc(),
        }
    return {
        "ok": True,
        "version": result.version,
        "engine_name": result.engine_name,
        "digest": result.digest,
        "mode": result.mode,
    }


def publisher_on_rank0(rank: int) -> Any:
    from lorafleet.publisher import Publisher

    if rank != 0:
        return None
    return Publisher(
        agents=os.environ["LORAFLEET_TEST_AGENTS"].split(","),
        router=os.environ["LORAFLEET_TEST_ROUTER"],
        token=os.environ["LORAFLEET_TEST_TOKEN"],
    )


def run_wrap(opts: argparse.Namespace, base: Path, rank: int, report: dict[str, Any]) -> None:
    from lorafleet.integrations import distributed

    pub = publisher_on_rank0(rank)
    try:
        model = build(base, opts.wrap, R_OK)
        train_step(model)
        with record_materialised(model) as seen:
            report["publish"] = attempt(distributed.publish, model, pub, name=opts.name)
        report["materialised"] = seen
        # The LoRA parameters by their unwrapped names (FSDP1 hides them in flat parameters).
        plain = build(base, "plain", R_OK)
        report["lora_params"] = sorted(n for n, _ in plain.named_parameters() if ".lora_" in n)
        report["lora_numel"] = sum(p.numel() for n, p in plain.named_parameters() if ".lora_" in n)
        del plain

        if opts.wrap == "fsdp2":
            # The fallback for other placements (HSDP, TP): one full_tensor() per parameter.
            distributed._BATCH_SHARDS = False
            try:
                with record_materialised(model) as seen:
                    one_by_one = distributed.gather_adapter(model)
            finally:
                distributed._BATCH_SHARDS = True
            batched = distributed.gather_adapter(model)
            report["unbatched"] = {
                "materialised": seen,
                "same_tensors": rank != 0
                or (
                    one_by_one[0].keys() == batched[0].keys()
                    and all(torch.equal(v, batched[0][k]) for k, v in one_by_one[0].items())
                ),
            }
        save_reference(model, opts.wrap, base, R_OK, Path(opts.out) / "adapter", rank)

        # A refusal on rank 0: the replicas refuse this rank. Every rank must raise it.
        big = build(base, opts.wrap, R_REFUSED)
        report["refused"] = attempt(distributed.publish, big, pub, name=opts.name)
        del big

        # Misuse on rank 0 (no publisher there): every rank raises, none waits forever.
        report["no_publisher"] = attempt(distributed.publish, model, None, name=opts.name)

        if opts.wrap == "fsdp1":
            # One FSDP1 unit for the whole model: LoRA shares a flat parameter with base weights.
            mixed = build(base, "fsdp1-mixed", R_OK)
            with record_materialised(mixed) as seen:
                report["mixed"] = attempt(distributed.publish, mixed, pub, name=opts.name)
            report["mixed"]["materialised"] = seen
            del mixed

        if opts.wrap == "ddp":
            # Megatron-style: rank 0 holds a gathered native checkpoint; the others pass None.
            from peft import get_peft_model_state_dict

            from lorafleet.bundle.bundle import peft_config_dict

            peft_model = _peft(model)
            state = get_peft_model_state_dict(peft_model) if rank == 0 else None
            config = peft_config_dict(peft_model.peft_config["default"])
            report["state_dict"] = attempt(
                distributed.publish, state, pub, name=opts.name, config=config
            )
    finally:
        if pub is not None:
            pub.close()


def run_trainer(opts: argparse.Namespace, base: Path, rank: int, report: dict[str, Any]) -> None:
    """A real ``transformers.Trainer`` under torchrun (DDP on CPU) with the callback."""
    from transformers import Trainer, TrainingArguments

    from lorafleet.integrations.transformers import VERSION_KEY, LorafleetCallback
    from lorafleet.testing import make_peft_model

    model = make_peft_model(base, r=R_OK, seed=1)
    ids = list(range(2, 18))
    data = [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids}] * 8
    pub = publisher_on_rank0(rank)
    try:
        callback = LorafleetCallback(pub, opts.name, every_n_steps=2)
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(Path(opts.out) / f"trainer{rank}"),
                max_steps=3,
                per_device_train_batch_size=1,
                learning_rate=5e-3,
                logging_steps=100,
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                disable_tqdm=True,
            ),
            train_dataset=data,
            callbacks=[callback],
        )
        trainer.train()
    finally:
        if pub is not None:
            pub.close()
    report["wrapped"] = type(trainer.model_wrapped).__name__
    report["versions"] = [r.version for r in callback.results]
    report["digests"] = [r.digest for r in callback.results]
    report["logged"] = [
        [e["step"], e[VERSION_KEY]] for e in trainer.state.log_history if VERSION_KEY in e
    ]
    if rank == 0:
        model.save_pretrained(str(Path(opts.out) / "adapter"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", choices=["fsdp2", "fsdp1", "ddp"])
    ap.add_argument("--trainer", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    opts = ap.parse_args()

    from lorafleet.tinymodel import ensure_tiny_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if not opts.trainer:  # the Trainer sets its process group up itself (gloo on CPU)
        dist.init_process_group("gloo")
    report: dict[str, Any] = {"rank": rank}
    try:
        base = ensure_tiny_model()
        if opts.trainer:
            run_trainer(opts, base, rank, report)
        else:
            run_wrap(opts, base, rank, report)
    except Exception:
        report["crash"] = traceback.format_exc()
        raise
    finally:
        Path(opts.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
        if dist.is_initialized():
            if "crash" not in report:
                # Both ranks past their last collective before either tears gloo down: one
                # rank's teardown racing the other's once aborted it at exit ("terminate
                # called without an active exception") after both had reported success.
                dist.barrier()
            dist.destroy_process_group()
    # What is left is the interpreter's own teardown, where gloo's threads once aborted the
    # rank the same way: the report is written, the group destroyed, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
