"""lorafleet's pure-torch stand-in for the ``sgl_kernel`` CPU ops of SGLang 0.5.23.

scripts/setup-sglang.sh copies this package into the SGLang venv's site-packages, so a server
started from that venv with ``SGLANG_USE_CPU_ENGINE=1`` needs no PYTHONPATH. It exists because
the published ``sgl-kernel``/``sglang-kernel`` wheels are CUDA-only (see docs/engines/sglang.md).

Only for CPUs without AMX, where SGLang already falls back to torch-native layers. It is not the
real sgl-kernel: it registers no ``torch.ops.sgl_kernel.*`` ops (so SGLang's AMX path stays off
even on an AMX CPU), implements the one op the Llama + LoRA path calls
(``assign_req_to_token_pool_cpu``), and makes every other name importable but loud if called.
Pinned to sglang==0.5.23: another version may call other ops.
"""

import contextlib

import torch

__version__ = "0.0.0+lorafleet.torchshim"

# SGLang 0.5.23's LoRA code asks for pinned host memory in many places (pin_memory=True,
# .pin_memory()). A CPU-only torch has no pinned-memory allocator and raises, so pinning becomes
# a no-op when there is no accelerator. This runs only in processes that import sgl_kernel, i.e.
# SGLang's CPU engine in its own venv.
if not torch.cuda.is_available():
    import functools as _ft

    def _drop_pin(fn):
        @_ft.wraps(fn)
        def wrapper(*a, **kw):
            kw.pop("pin_memory", None)
            return fn(*a, **kw)

        return wrapper

    _PINNABLE = (
        "tensor empty zeros ones arange full empty_strided empty_like zeros_like ones_like"
        " full_like as_tensor"
    )
    for _n in _PINNABLE.split():
        if hasattr(torch, _n):
            with contextlib.suppress(Exception):  # best effort: a builtin may refuse setattr
                setattr(torch, _n, _drop_pin(getattr(torch, _n)))
    torch.Tensor.pin_memory = lambda self, *a, **kw: self


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Write each request's new KV slots into its row of the req->token table."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    off = 0
    for r, s, e in zip(rows, starts, ends, strict=True):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    raise NotImplementedError("sgl_kernel.copy_all_layer_kv_cache_cpu is not in the torch shim")


def __getattr__(name):
    # Any other op: importable (SGLang imports many at module level), but loud if ever called.
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in the torch shim")

    _missing.__name__ = name
    return _missing
