"""Publish a PEFT adapter from a sharded trainer: one collective call on every rank.

::

    import torch.distributed as dist
    from lorafleet.integrations import distributed

    publisher = Publisher(agents, router=router, token=token) if dist.get_rank() == 0 else None
    ...
    model = get_peft_model(base, lora_config)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ...
    result = distributed.publish(model, publisher, name="policy")   # on every rank

Every rank in ``group`` calls :func:`publish` at the same point. Only the adapter's own tensors
(what ``peft.get_peft_model_state_dict`` keeps: the LoRA matrices, plus ``modules_to_save`` or
embeddings when the config asks for them) are gathered, to ``publisher_rank`` only; the base
weights stay sharded. ``publisher_rank`` builds the bundle in memory and publishes it; then it
broadcasts the outcome, so that every rank returns the same ``PublishResult`` or raises the same
error (type, message, attributes such as ``PublishError.failures``). The publishing rank
broadcasts even when it fails, so no rank hangs. Before any gather the ranks exchange their
plans (one small object collective), so a rank that cannot take part (not a PEFT model, an
unsupported wrapping, no publisher on ``publisher_rank``) makes every rank raise that error.

How each wrapping is handled:

- **FSDP2** (``fully_shard``): every rank packs its local shards of the adapter parameters
  (``Shard(0)`` on one 1-D mesh) into one buffer, and one ``gather`` brings them to
  ``publisher_rank``, which cuts the rows back out. Any other ``DTensor`` layout (HSDP, TP) is
  gathered one parameter at a time with ``full_tensor()``. Base parameters are never touched.
- **FSDP1** (``FullyShardedDataParallel``): FSDP1 gathers whole units (flat parameters), so the
  adapter must live in units of its own. ``peft.utils.other.fsdp_auto_wrap_policy`` does that
  (``transformers.Trainer`` and accelerate apply it to PEFT models). Each such unit is gathered
  alone with ``summon_full_params(unit, recurse=False, writeback=False)``, never with
  ``rank0_only`` or ``offload_to_cpu``: that combination segfaults on CPU. A unit that holds base
  weights beside adapter weights is refused before anything is gathered. ``modules_to_save`` and
  trainable tokens are not supported under FSDP1 (their state-dict hooks gather collectively).
- **DDP** and plain modules: every rank holds the whole adapter; ``publisher_rank`` reads its own
  copy and nothing is gathered.
- **A state dict** (Megatron-style native checkpoints, gathered by the framework), a PEFT
  directory or an ``AdapterBundle``: pass it on ``publisher_rank`` with ``config=`` as for
  ``Publisher.publish``; the other ranks may pass ``None``. Nothing is gathered.
- DeepSpeed ZeRO-3 parameters are refused: gather them with DeepSpeed and pass a state dict.

Limits: the other ranks wait in one broadcast while ``publisher_rank`` publishes, so the process
group's timeout (``init_process_group(timeout=...)``; 10 min for NCCL, 30 min for gloo by
default) must exceed the longest publication. A rank that dies inside a collective (out of memory
while gathering, a killed process) leaves the others waiting for that timeout, as any collective
does. Object collectives on NCCL need ``torch.cuda.set_device`` first, as usual.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import math
import os
import pickle
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lorafleet.bundle.bundle import AdapterBundle, peft_config_dict
from lorafleet.errors import _rebuild_exception

__all__ = ["gather_adapter", "is_distributed", "publish"]

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def is_distributed(group: Any = None) -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# -- the plan: which tensors make up the adapter, and how each one is materialised -------------


@dataclass
class _Plan:
    """What one rank will do; every rank of a gathering plan must build the same one."""

    kind: str
    """``fsdp2`` (DTensor parameters), ``fsdp1``, ``local`` (DDP, plain) or ``given`` (a state
    dict, directory or bundle on the publishing rank: nothing to gather)."""
    keys: dict[str, str] = field(default_factory=dict)
    """PEFT checkpoint key -> the parameter's name in the (possibly wrapped) PeftModel."""
    config: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict, repr=False)
    """Raw name -> the tensor (a DTensor, a local tensor) for ``fsdp2`` and ``local``."""
    units: list[tuple[Any, dict[str, str]]] = field(default_factory=list, repr=False)
    """``fsdp1``: (FSDP unit, {raw name: name relative to the unit's wrapped module})."""
    source: Any = field(default=None, repr=False)
    shards_match: bool = False
    """This rank's DTensor shards have the shapes ``_shard0_rows`` predicts (a local check)."""
    batched: bool = False
    """Set by the agreement when every rank's shards match: one collective for all of them."""

    @property
    def gathers(self) -> bool:
        return self.kind in ("fsdp2", "fsdp1", "local")

    def signature(self) -> str:
        """A digest of what this rank will gather, in order: ranks must agree on it."""
        h = hashlib.sha256(self.kind.encode())
        for key, raw in self.keys.items():
            t = self.tensors.get(raw)
            shape = tuple(t.shape) if t is not None else ()
            h.update(f"\0{key}\0{raw}\0{type(t).__name__}\0{shape}".encode())
        for _unit, names in self.units:
            h.update(("\1" + "\0".join(names)).encode())
        return h.hexdigest()


def _peft_model(model: Any) -> Any:
    """The PeftModel under DDP, FSDP1, accelerate and ``torch.compile`` wrappers.

    Children are looked up in ``_modules``: FSDP1 forwards attribute lookups to the module it
    wraps, so ``hasattr(fsdp_root, "peft_config")`` holds for the wrapper itself, whose
    parameter names carry ``_fsdp_wrapped_module.`` (why PEFT then finds no adapter keys).
    """
    inner = model
    while not (hasattr(type(inner), "peft_config") or "peft_config" in vars(inner)):
        children = getattr(inner, "_modules", {})
        nxt = next(
            (children[k] for k in ("_fsdp_wrapped_module", "module", "_orig_mod") if k in children),
            None,
        )
        if nxt is None:
            break
        inner = nxt
    if not hasattr(inner, "peft_config"):
        raise TypeError(
            f"a PEFT model (possibly wrapped) is needed, got {type(model).__name__}; "
            "pass a state dict with config= for other checkpoints"
        )
    return inner


def _clean(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def _checkpoint_key(key: str, adapter_name: str) -> str:
    """``key`` without wrapper segments, and without the adapter name they hid from PEFT.

    PEFT drops the adapter name only when it is the last or second-to-last segment
    (``lora_A.default.weight``); FSDP1 names put its wrapper in between
    (``lora_A.default._fsdp_wrapped_module.weight``), so the drop is redone once cleaned.
    """
    clean = _clean(key)
    if clean == key:
        return key
    head, _, last = clean.rpartition(".")
    if last == adapter_name:
        return head
    return head.removesuffix(f".{adapter_name}") + "." + last


def _adapter_keys(peft_model: Any, raw_names: list[str], adapter_name: str) -> dict[str, str]:
    """PEFT's own choice of adapter keys, computed on names only (no tensor is read).

    ``get_peft_model_state_dict`` is given ``{raw name: raw name}``: it selects and renames keys
    structurally, so what comes back maps each checkpoint key to the parameter to gather.
    """
    from peft import get_peft_model_state_dict

    try:
        picked = get_peft_model_state_dict(
            peft_model, state_dict={n: n for n in raw_names}, adapter_name=adapter_name
        )
    except KeyError as exc:
        raise NotImplementedError(
            f"this adapter's extra modules cannot be located under this wrapping ({exc}); "
            "use FSDP2 or pass a gathered state dict with config="
        ) from exc
    out: dict[str, str] = {}
    for key, raw in picked.items():
        if not isinstance(raw, str):
            raise NotImplementedError(
                f"PEFT derives {key!r} from several tensors; not supported when sharded"
            )
        out[_checkpoint_key(key, adapter_name)] = raw
    if not out:
        raise ValueError(f"the PEFT model has no tensors for adapter {adapter_name!r}")
    return out


def _named_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """Parameters and persistent buffers by name, as ``state_dict`` would key them."""
    yield from module.named_parameters(remove_duplicate=False)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for b_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and b_name not in skip:
                yield (f"{mod_name}.{b_name}" if mod_name else b_name), buf


def _fsdp1_units(peft_model: Any, model: Any) -> list[tuple[str, Any]]:
    """Every FSDP1 unit at or under ``model``, with its path in ``peft_model`` (``""``: root)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(model)
    if not units:
        return []
    path = {id(m): n for n, m in peft_model.named_modules(remove_duplicate=False)}
    # The root unit wraps the PeftModel; the others sit inside it. A unit above the PeftModel
    # other than its direct wrapper holds no adapter weights.
    return [(path.get(id(u), ""), u) for u in units if u.module is peft_model or id(u) in path]


def _plan_fsdp1(model: Any, peft_model: Any, adapter_name: str) -> _Plan:
    from peft.utils.other import AuxiliaryTrainingWrapper

    if any(isinstance(m, AuxiliaryTrainingWrapper) for m in peft_model.modules()):
        raise NotImplementedError(
            "modules_to_save / trainable tokens are not supported under FSDP1 (their state-dict "
            "hooks gather collectively); use FSDP2 (fully_shard)"
        )
    owner: dict[str, tuple[Any, str]] = {}  # raw name -> (unit, name relative to its module)
    for path, unit in _fsdp1_units(peft_model, model):
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if handle is None or flat is None:
            continue  # a unit that manages no parameters
        fqns = getattr(flat, "_fqns", None)
        if fqns is None:
            raise NotImplementedError(
                "this torch version's FSDP1 has no FlatParameter._fqns; use FSDP2 (fully_shard)"
            )
        # ``_fqns`` are relative to the module the unit wraps.
        base = "" if unit.module is peft_model else f"{path}._fsdp_wrapped_module."
        for fqn in fqns:
            owner[base + fqn] = (unit, fqn)
    tensors = {
        n: t for n, t in _named_tensors(peft_model) if n not in owner and not hasattr(t, "_fqns")
    }
    keys = _adapter_keys(peft_model, [*owner, *tensors], adapter_name)
    wanted = set(keys.values())
    units: dict[int, tuple[Any, dict[str, str]]] = {}
    for raw in keys.values():
        if raw in owner:
            unit, rel = owner[raw]
            units.setdefault(id(unit), (unit, {}))[1][raw] = rel
    for unit, names in units.values():
        others = [
            n for n, (u, _rel) in owner.items() if u is unit and n not in wanted and n not in names
        ]
        if others:
            raise ValueError(
                f"an FSDP1 unit holds base weights beside adapter weights ({_clean(others[0])} "
                f"with {_clean(next(iter(names)))}); gathering it would gather the base weights. "
                "Wrap the LoRA layers in units of their own (auto_wrap_policy="
                "peft.utils.other.fsdp_auto_wrap_policy(model), as transformers.Trainer does) "
                "or use FSDP2 (fully_shard)"
            )
    plan = _Plan(kind="fsdp1", keys=keys, units=list(units.values()))
    plan.tensors = {raw: tensors[raw] for raw in keys.values() if raw in tensors}
    return plan


def _plan(model: Any, adapter_name: str) -> _Plan:
    """Which tensors to gather, how, and under which checkpoint keys. Local; no collective."""
    if model is None or isinstance(model, AdapterBundle | str | os.PathLike | Mapping):
        return _Plan(kind="given", source=model)
    peft_model = _peft_model(model)
    if any(hasattr(p, "ds_id") for p in peft_model.parameters()):
        raise NotImplementedError(
            "DeepSpeed ZeRO-3 parameters are partitioned by DeepSpeed: gather the adapter with "
            "deepspeed.zero.GatheredParameters and pass the state dict with config="
        )
    if adapter_name not in peft_model.peft_config:
        have = sorted(peft_model.peft_config)
        raise ValueError(f"the PEFT model has no adapter {adapter_name!r} (it has {have})")
    config = peft_config_dict(peft_model.peft_config[adapter_name])
    if _fsdp1_units(peft_model, model):
        plan = _plan_fsdp1(model, peft_model, adapter_name)
    else:
        tensors = dict(_named_tensors(peft_model))
        keys = _adapter_keys(peft_model, list(tensors), adapter_name)
        plan = _Plan(kind="local", keys=keys)
        plan.tensors = {raw: tensors[raw] for raw in keys.values()}
        if any(_is_dtensor(t) for t in plan.tensors.values()):
            plan.kind = "fsdp2"
            plan.shards_match = _shards_match([t for t in plan.tensors.values() if _is_dtensor(t)])
    plan.config = config
    return plan


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# -- the gather ------------------------------------------------------------------------------

_BATCH_SHARDS = True
"""Gather every ``Shard(0)`` DTensor in one collective (False: one ``full_tensor`` each)."""


def _shard0_rows(rows: int, ranks: int) -> list[int]:
    """Rows of each rank's ``Shard(0)`` chunk, as DTensor and FSDP2 cut (``torch.chunk``)."""
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(ranks)]


def _batch_mesh(dtensors: list[Any], dst: int) -> Any:
    """The 1-D mesh that every DTensor is ``Shard(0)`` on, if one batched gather can serve them.

    Depends only on what every rank sees alike (meshes, placements, dtypes), so every rank
    decides the same way. ``None``: gather each tensor with ``full_tensor()`` instead.
    """
    from torch.distributed.tensor import Shard

    if not dtensors:
        return None
    first = dtensors[0]
    mesh = first.device_mesh
    if mesh.ndim != 1:
        return None
    for t in dtensors:
        if (
            t.device_mesh != mesh
            or tuple(t.placements) != (Shard(0),)
            or t.dtype != first.dtype
            or t.device != first.device
            or t.dim() == 0
        ):
            return None
    ranks = mesh.mesh.flatten().tolist()
    if dst not in ranks or dist.get_process_group_ranks(mesh.get_group()) != ranks:
        return None
    return mesh


def _shards_match(dtensors: list[Any]) -> bool:
    """Whether this rank's local shards have the shapes ``_shard0_rows`` predicts."""
    try:
        for t in dtensors:
            mesh = t.device_mesh
            if mesh.ndim != 1:
                return False
            rows = _shard0_rows(t.shape[0], mesh.size())[mesh.get_local_rank()]
            if tuple(t.to_local().shape) != (rows, *t.shape[1:]):
                return False
    except Exception:
        return False
    return True


def _gather_shards(dtensors: list[tuple[list[str], Any]], mesh: Any, dst: int, keep: Any) -> None:
    """One ``gather`` to ``dst`` of every rank's local shards, packed in one flat buffer.

    Each rank sends only its own slices of the adapter's parameters (padded to the longest
    rank's length); ``dst`` cuts them back out and concatenates each parameter's rows.
    """
    width = mesh.size()
    first = dtensors[0][1]
    rows = [_shard0_rows(t.shape[0], width) for _raws, t in dtensors]
    per_row = [math.prod(t.shape[1:]) for _raws, t in dtensors]
    totals = [sum(r[k] * n for r, n in zip(rows, per_row, strict=True)) for k in range(width)]
    # The collective runs on the mesh's device (CPU-offloaded FSDP2 keeps shards on the CPU
    # while its NCCL group takes only GPU tensors), as torch's own state-dict gather does.
    buf = torch.zeros(max(totals), dtype=first.dtype, device=torch.device(mesh.device_type))
    offset = 0
    for _raws, t in dtensors:
        local = t.to_local().detach().reshape(-1)
        buf[offset : offset + local.numel()].copy_(local)
        offset += local.numel()
    on_dst = dist.get_rank() == dst
    received = [torch.empty_like(buf) for _ in range(width)] if on_dst else None
    dist.gather(buf, received, dst=dst, group=mesh.get_group())
    del buf
    if received is None:
        return
    offsets = [0] * width
    for i, (raws, t) in enumerate(dtensors):
        pieces = []
        for k in range(width):
            n = rows[i][k] * per_row[i]
            pieces.append(received[k][offsets[k] : offsets[k] + n].view(rows[i][k], *t.shape[1:]))
            offsets[k] += n
        full = torch.cat(pieces)
        for j, raw in enumerate(raws):
            keep(raw, full, fresh=j == 0)  # tied names get copies: safetensors refuses aliases


def _full_tensor(t: Any) -> torch.Tensor:
    """``t.full_tensor()`` (a collective over its mesh), on the mesh's device as torch does."""
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def _gather(plan: _Plan, *, dst: int) -> tuple[dict[str, torch.Tensor], BaseException | None]:
    """Materialise the plan's tensors on rank ``dst`` (CPU), collectively.

    Every rank steps through every collective even after a local failure on the destination
    (copying to CPU, say), so that the ranks stay in step; the failure is returned, not raised.
    """
    on_dst = _rank() == dst
    out: dict[str, torch.Tensor] = {}
    failure: BaseException | None = None

    def keep(raw: str, t: torch.Tensor, fresh: bool = False) -> None:
        """Hold a CPU copy on ``dst`` (``fresh``: ``t`` is already ours, no copy on CPU)."""
        nonlocal failure
        if not on_dst or failure is not None:
            return
        try:
            out[raw] = t.detach().to("cpu", copy=not fresh)
        except Exception as exc:
            failure = exc

    # Tied parameters appear under several names: one collective per tensor, on every rank.
    names_of: dict[int, list[str]] = {}
    for raw, t in plan.tensors.items():
        names_of.setdefault(id(t), []).append(raw)
    groups = [(raws, plan.tensors[raws[0]]) for raws in names_of.values()]
    dtensors = [(raws, t) for raws, t in groups if _is_dtensor(t)]
    mesh = _batch_mesh([t for _raws, t in dtensors], dst) if plan.batched else None
    if mesh is not None:
        _gather_shards(dtensors, mesh, dst, keep)
    for raws, t in groups:
        if mesh is not None and _is_dtensor(t):
            continue
        full = _full_tensor(t) if _is_dtensor(t) else t
        for j, raw in enumerate(raws):
            keep(raw, full, fresh=j == 0 and _is_dtensor(t))
        del full
    if plan.units:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for unit, names in plan.units:
            # rank0_only/offload_to_cpu stay off: with a CPU-offloaded FSDP1 model that
            # combination segfaults on CPU. Each unit is gathered alone (recurse=False).
            with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                for raw, rel in names.items():
                    keep(raw, functools.reduce(getattr, rel.split("."), unit.module))
    return {key: out[raw] for key, raw in plan.keys.items() if raw in out}, failure


def gather_adapter(
    model: Any,
    *,
    adapter_name: str = "default",
    group: Any = None,
    dst: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Gather only the adapter's tensors of a (sharded) PEFT model to rank ``dst``. Collective.

    Returns ``(state_dict, config)`` on ``dst``, with PEFT's checkpoint keys (as
    ``get_peft_model_state_dict`` gives them) and CPU tensors, and ``None`` on the other ranks.
    Every rank of ``group`` must call it. Raises the same error on every rank if any rank cannot
    plan the gather (``TypeError`` for a model that is not PEFT, ``ValueError`` for an FSDP1 unit
    mixing base and adapter weights, ``NotImplementedError`` for unsupported wrappings).
    """
    plan, error = _agree(_try_plan(model, adapter_name), group=group, dst=dst)
    if error is not None:
        raise error
    if not plan.gathers:
        raise TypeError("gather_adapter needs a PEFT model on every rank")
    try:
        tensors, failure = _gather(plan, dst=dst)
    except Exception as exc:  # inside a collective: usually every rank fails alike
        tensors, failure = {}, exc
    failure = _share_failure(failure, group=group, dst=dst)
    if failure is not None:
        raise failure
    return (tensors, plan.config) if _rank() == dst else None


# -- agreement and outcome, over the process group -----------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Pickler(pickle.Pickler):
    """Pickle that carries any exception whole, whatever its constructor's signature.

    An exception is reduced to its class's import path, ``args`` and picklable attributes,
    and rebuilt by ``_restore_exception`` without calling its constructor (as
    ``LorafleetError.__reduce__`` does for lorafleet's own); what cannot travel (an attribute
    holding a lock) is left behind, and a class the receiving rank cannot import becomes a
    ``RuntimeError`` naming it. The rebuilt exception notes the rank and its traceback.
    """

    def __init__(self, file: Any, rank: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.rank = rank

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, BaseException):
            return NotImplemented
        args = obj.args if _picklable(obj.args) else (str(obj),)
        state = {k: v for k, v in vars(obj).items() if not k.startswith("__") and _picklable(v)}
        trace = "".join(traceback.format_exception(type(obj), obj, obj.__traceback__))
        cls = type(obj)
        return _restore_exception, (
            cls.__module__,
            cls.__qualname__,
            args,
            state,
            str(obj),
            self.rank,
            trace,
        )


def _picklable(v: Any) -> bool:
    try:
        pickle.dumps(v)
        return True
    except Exception:
        return False


def _dumps(obj: Any, rank: int) -> bytes:
    """``obj`` pickled on ``rank``, exceptions in it by ``_Pickler``'s rule."""
    buf = io.BytesIO()
    _Pickler(buf, rank).dump(obj)
    return buf.getvalue()


def _restore_exception(
    module: str, qualname: str, args: tuple, state: dict, text: str, rank: int, trace: str
) -> BaseException:
    """The same class, args and attributes; a ``RuntimeError`` naming it if impossible."""
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(qualname)
        exc = _rebuild_exception(cls, args, state)
        str(exc)  # a __str__ that needs a missing attribute fails here, not in the caller
    except Exception:
        exc = RuntimeError(f"rank {rank} failed: {qualname}: {text}")
    exc.add_note(f"raised on rank {rank}, which printed:\n{trace.rstrip()}")
    return exc


def _try_plan(model: Any, adapter_name: str) -> _Plan | BaseException:
    try:
        return _plan(model, adapter_name)
    except Exception as exc:
        return exc


def _agree(
    mine: _Plan | BaseException, *, group: Any, dst: int
) -> tuple[_Plan | None, BaseException | None]:
    """Exchange plans; every rank gets back the same verdict (its plan, or one error).

    The destination's plan decides: a ``given`` source needs nothing from the other ranks; a
    gathering plan needs the same plan (same tensors, same order) on every rank, or the
    collectives of the gather would not line up.
    """
    if not is_distributed(group):
        return (None, mine) if isinstance(mine, BaseException) else (mine, None)
    me = _rank()
    failed = isinstance(mine, BaseException)
    summary: Any = _dumps(mine, me) if failed else mine.signature()
    kind = None if failed else mine.kind
    match = not failed and mine.shards_match
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (me, kind, summary, match), group=group)
    # A failed rank's summary is its exception, pickled; a plan's is a tuple.
    by_rank = {r: (k, pickle.loads(s) if isinstance(s, bytes) else s) for r, k, s, _m in everyone}
    if dst not in by_rank:
        return None, ValueError(f"rank {dst} is not in the process group {sorted(by_rank)}")
    dst_kind, dst_summary = by_rank[dst]
    if isinstance(dst_summary, BaseException):
        return None, _local_or_remote(mine, dst_summary, dst, me)
    if dst_kind == "given":
        return (mine if me == dst else _Plan(kind="given")), None  # type: ignore[return-value]
    for r in sorted(by_rank):
        _kind, summary = by_rank[r]
        if isinstance(summary, BaseException):
            return None, _local_or_remote(mine, summary, r, me)
    differ = sorted(r for r, (k, s) in by_rank.items() if (k, s) != (dst_kind, dst_summary))
    if differ:
        return None, ValueError(
            f"ranks {differ} would gather other tensors than rank {dst} ({dst_kind}): every "
            f"rank must pass the same wrapped PEFT model (or rank {dst} a state dict)"
        )
    assert isinstance(mine, _Plan)
    mine.batched = _BATCH_SHARDS and all(m for *_rest, m in everyone)
    return mine, None


def _local_or_remote(mine: Any, remote: BaseException, rank: int, me: int) -> BaseException:
    """The failing rank raises its own exception (with its traceback); the others its copy."""
    return mine if rank == me and isinstance(mine, BaseException) else remote


def _share_failure(failure: BaseException | None, *, group: Any, dst: int) -> BaseException | None:
    """Broadcast the destination's gather failure (or none) so that every rank raises it."""
    if not is_distributed(group):
        return failure
    me = _rank()
    box = [_dumps(failure, me) if failure is not None and me == dst else None]
    dist.broadcast_object_list(box, src=dst, group=group)
    if box[0] is None:
        return failure  # none on the destination; this rank's own, if any
    return failure if me == dst else pickle.loads(box[0])


def _payload(outcome: Any, rank: int) -> tuple[bytes, BaseException | None]:
    """``outcome`` pickled (an exception by ``_Pickler``'s rule); never raises.

    An outcome that cannot be pickled is replaced by a ``RuntimeError``, returned too, so that
    the sending rank raises what the others will.
    """
    try:
        return _dumps(outcome, rank), None
    except Exception as exc:
        err = RuntimeError(
            f"rank {rank} could not send its outcome, a {type(outcome).__name__} "
            f"({type(exc).__name__}: {exc})"
        )
        return _dumps(err, rank), err


def _broadcast_outcome(outcome: Any, *, group: Any, src: int) -> Any:
    """Send ``outcome`` (a result, or an exception) from ``src``; what every other rank got.

    The payload is pickled before the collective, so that nothing on ``src`` can fail inside
    the broadcast and strand the others: an outcome that cannot be pickled becomes an error.
    """
    me = _rank()
    payload, substitute = _payload(outcome, me) if me == src else (b"", None)
    box = [payload]
    dist.broadcast_object_list(box, src=src, group=group)
    if me == src:
        return substitute if substitute is not None else outcome
    try:
        return pickle.loads(box[0])
    except Exception as exc:
        return exc


# -- the collective publish ----------------------------------------------------------------------


def publish(
    model: Any,
    publisher: Any,
    *,
    name: str,
    group: Any = None,
    publisher_rank: int = 0,
    adapter_name: str = "default",
    **publish_kwargs: Any,
) -> Any:
    """Publish the adapter of a (sharded) PEFT model from ``publisher_rank``. Collective.

    Args:
        model: on every rank, the PEFT model as the trainer holds it (FSDP2, FSDP1, DDP,
            accelerate or ``torch.compile`` wrappers are looked through). Or, on
            ``publisher_rank`` only, what ``Publisher.publish`` takes (a state dict with
            ``config=``, a directory, a bundle), the other ranks passing ``None``.
        publisher: a ``lorafleet.publisher.Publisher`` on ``publisher_rank``; ignored (pass
            ``None``) on the other ranks.
        name: the adapter name clients use as ``model=``.
        group: the process group whose ranks all call this (default: the world); it must hold
            every rank the adapter is sharded over.
        publisher_rank: the global rank that holds the publisher.
        adapter_name: the PEFT adapter to publish.
        publish_kwargs: passed to ``publisher.publish`` (``mode=``, ``version=``, ``config=``...).

    Returns the same ``PublishResult`` on every rank.

    Raises, on every rank alike: what ``Publisher.publish`` raises (``PublishError`` and its
    subclasses, ``AdapterInvalid``...); ``TypeError`` for a model that is not PEFT;
    ``ValueError`` when the ranks pass different models, when an FSDP1 unit mixes base and
    adapter weights, or when ``publisher_rank`` has no publisher; ``NotImplementedError`` for
    DeepSpeed ZeRO-3 and for adapter extras a wrapping cannot gather.
    """
    me = _rank()
    on_dst = me == publisher_rank
    mine = _try_plan(model, adapter_name)
    if on_dst and publisher is None and not isinstance(mine, BaseException):
        mine = ValueError(f"rank {publisher_rank} publishes, so it needs a Publisher, not None")
    plan, error = _agree(mine, group=group, dst=publisher_rank)
    if error is not None:
        raise error
    assert plan is not None

    tensors: dict[str, torch.Tensor] = {}
    failure: BaseException | None = None
    if plan.gathers:
        try:
            tensors, failure = _gather(plan, dst=publisher_rank)
        except Exception as exc:  # inside a collective: usually every rank fails alike
            failure = exc
    if not is_distributed(group):
        if failure is not None:
            raise failure
        return _publish_here(plan, tensors, publisher, name, publish_kwargs)

    outcome: Any = None
    if on_dst:
        try:
            if failure is not None:
                raise failure
            outcome = _publish_here(plan, tensors, publisher, name, publish_kwargs)
        except BaseException as exc:  # KeyboardInterrupt too: the others must hear of it
            outcome = exc
    tensors.clear()
    # Reached on the publishing rank whatever happened above: the other ranks wait here.
    shared = _broadcast_outcome(outcome, group=group, src=publisher_rank)
    if on_dst and isinstance(outcome, BaseException):
        raise outcome  # the original, with its traceback
    if isinstance(shared, BaseException):
        raise shared
    if failure is not None:
        raise failure  # this rank's own gather failed though the publication went through
    return outcome if on_dst else shared


def _publish_here(
    plan: _Plan,
    tensors: dict[str, torch.Tensor],
    publisher: Any,
    name: str,
    publish_kwargs: dict[str, Any],
) -> Any:
    if plan.kind == "given":
        return publisher.publish(plan.source, name=name, **publish_kwargs)
    kwargs = dict(publish_kwargs)
    config = kwargs.pop("config", None) or plan.config
    return publisher.publish(tensors, name=name, config=config, **kwargs)
