"""Gathering a LoRA adapter from an FSDP2-sharded model: LoRA-only vs the full state dict.

A random Llama model (``--hidden/--layers/--vocab``; the default is 134M parameters) with a LoRA
of rank ``--rank`` on every linear projection, sharded with ``fully_shard`` over 2 processes
(gloo, loopback, CPU). Methods, each timed ``--rounds`` times on rank 0, in this order (memory
peaks only grow, so the cheapest runs first):

- ``limit``: one raw ``all_gather_into_tensor`` of as many bytes as the adapter; what moving
  those bytes over this process group costs at best.
- ``lora_only``: ``lorafleet.integrations.distributed.gather_adapter`` (what ``publish`` does):
  ``full_tensor()`` on each adapter parameter only, copies on rank 0.
- ``trainable``: torch's ``get_model_state_dict(full_state_dict, cpu_offload,
  ignore_frozen_params)`` then ``get_peft_model_state_dict``.
- ``full``: torch's ``get_model_state_dict(full_state_dict, cpu_offload)`` of the whole model
  then ``get_peft_model_state_dict`` (what saving a sharded model usually does).

Per method: median and spread of the time, rank 0's peak RSS growth (VmHWM) over the method's
rounds, and its RSS growth while it holds one result. Both ranks share the machine's cores, so a
busy machine slows every method; compare ratios within one run.

Usage: python bench/dist_gather.py [--rounds 5] [--hidden 768 --layers 12 --vocab 32000]
(it starts itself under ``torchrun --nproc-per-node 2`` on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str]) -> int:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [
        str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), __file__, *argv,
    ]  # fmt: skip
    return subprocess.call(cmd, env=env)


def run(opts: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorafleet.integrations.distributed import gather_adapter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=opts.hidden,
        intermediate_size=opts.hidden * 8 // 3,
        num_hidden_layers=opts.layers,
        num_attention_heads=opts.hidden // 64,
        num_key_value_heads=opts.hidden // 64,
        vocab_size=opts.vocab,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    base_params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=opts.rank, target_modules="all-linear"))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    lora_numel = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    gc.collect()

    per_rank = -(-lora_numel // 2)
    send = torch.zeros(per_rank)
    recv = torch.empty(2 * per_rank)

    def limit():
        dist.all_gather_into_tensor(recv, send)
        return recv

    def lora_only():
        out = gather_adapter(model)
        return out[0] if out else None

    def torch_sd(**kw):
        def f():
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)
            )
            return get_peft_model_state_dict(model, state_dict=full) if rank == 0 else None

        return f

    methods = {
        "limit": limit,
        "lora_only": lora_only,
        "trainable": torch_sd(ignore_frozen_params=True),
        "full": torch_sd(),
    }
    if rank == 0:
        print(
            f"model: {base_params / 1e6:.0f}M base parameters ({base_params * 4 / MiB:.0f} MiB "
            f"fp32), LoRA r={opts.rank} all-linear: {lora_numel / 1e6:.2f}M parameters "
            f"({lora_numel * 4 / MiB:.1f} MiB); 2 ranks, gloo on loopback, CPU; "
            f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            flush=True,
        )
    results = {}
    reference = None
    for name, fn in methods.items():
        times, held = [], []
        dist.barrier()
        hwm0 = _status_kib("VmHWM")
        for _ in range(opts.rounds):
            gc.collect()
            dist.barrier()
            rss0 = _status_kib("VmRSS")
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            held.append(_status_kib("VmRSS") - rss0)
            times.append(dt)
            if name != "limit" and rank == 0:  # every method must gather the same adapter
                if reference is None:
                    reference = out
                assert set(out) == set(reference), name
                assert all(torch.equal(out[k], reference[k]) for k in out), name
            del out
        results[name] = (times, (_status_kib("VmHWM") - hwm0) * 1024, statistics.median(held))
    dist.barrier()
    if rank == 0:
        print(f"load average after: {os.getloadavg()[0]:.1f}\n", flush=True)
        print("| method | median s | min-max s | rank-0 peak RSS growth | RSS held |")
        print("|---|---|---|---|---|")
        for name, (times, peak, held) in results.items():
            print(
                f"| {name} | {statistics.median(times):.3f} | {min(times):.3f}-{max(times):.3f} "
                f"| {peak / MiB:+.0f} MiB | {held * 1024 / MiB:+.0f} MiB |"
            )
        med = {k: statistics.median(v[0]) for k, v in results.items()}
        print(
            f"\nfull / lora_only: {med['full'] / med['lora_only']:.1f}x time; "
            f"trainable / lora_only: {med['trainable'] / med['lora_only']:.1f}x; "
            f"lora_only / limit: {med['lora_only'] / med['limit']:.1f}x"
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    opts = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(sys.argv[1:]))
    run(opts)


if __name__ == "__main__":
    main()
