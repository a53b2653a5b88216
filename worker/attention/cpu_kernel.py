"""The CPU kernels: paged decode attention (``cpu_decode.c``) and the residual add fused with RMSNorm
(``worker/layers/cpu_norm.c``), built into one library once per machine with the system's C compiler, loaded
through ctypes (``common/native.py``: cached under ``$KVGRID_KERNEL_CACHE``, compiled for the CPU it runs on).
Without a compiler or the sources, or when the build or the load fails, ``load`` returns None and attention and
norms stay on the torch path, after one warning naming the cause (logger ``kvgrid.worker``; nothing falls back
silently).
``KVGRID_CPU_ATTENTION=auto|native|torch``: ``native`` makes a missing library an error, ``torch`` never uses it
(neither kernel).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from common import env, native

log = logging.getLogger("kvgrid.worker")

SOURCES = (Path(__file__).with_name("cpu_decode.c"), Path(__file__).parents[1] / "layers" / "cpu_norm.c")
# No -ffast-math: linked into a shared library it would switch the whole process to flush-to-zero on load. These
# let the compiler vectorize the float sums (reassociation) without touching torch's numerics.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
CHOICES = ("auto", "native", "torch")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lib: ctypes.CDLL | None = None
_tried = False


def choice() -> str:
    return env.cpu_attention()


def find_compiler() -> str | None:
    """The C compiler the kernel is built with (``common/native.py``)."""
    return native.find_compiler()


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None where it cannot be had or ``KVGRID_CPU_ATTENTION=torch``."""
    global _lib, _tried
    want = choice()
    if want == "torch":
        return None
    if not _tried:
        _tried = True
        try:
            lib = ctypes.CDLL(str(native.build("cpu_decode", SOURCES, FLAGS, find_compiler())))
            fn = lib.kvgrid_paged_decode
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # q, its row stride, K, V
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # tables, their stride, lens, out
                ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # n, heads, kv, dim, block
                ctypes.c_float, ctypes.c_int,  # scale, dtype
            ]  # fmt: skip
            norm = lib.kvgrid_add_rms_norm
            norm.restype = None
            norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:  # AttributeError: a symbol missing
            detail = getattr(e, "stderr", "") or ""
            log.warning(
                "CPU kernels (decode attention, RMSNorm) unavailable (%s%s); using the torch path", e, detail[-500:]
            )
    if _lib is None and want == "native":
        raise RuntimeError("KVGRID_CPU_ATTENTION=native, but the CPU decode kernel could not be built (see the log)")
    return _lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (CPU, float32 or bfloat16, a whole number of query heads per KV
    head); the caller checks ``load()`` too."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and q.shape[1] % k_cache.shape[2] == 0
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per row, ``q`` [n, heads, head_dim], over each row's ``seq_lens`` keys in the
    blocks ``block_tables`` [n, >= blocks needed] (int32) names. Returns [n, heads, head_dim] in q's dtype."""
    n, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    out = torch.empty(n, heads, head_dim, dtype=q.dtype)
    rc = lib.kvgrid_paged_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        n, heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, _DTYPES[q.dtype],
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU decode kernel failed ({rc}) for heads={heads}, kv_heads={k_cache.shape[2]}")
    return out


def add_rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h) * weight, h)`` with ``h = x + residual`` (or ``x``) for float32 rows [n, dim] on the CPU;
    the caller checks ``supports_norm``."""
    # Bound to names: a contiguous copy made inside the call's arguments would be freed before C reads it.
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    h = x if residual is None else torch.empty(rows, dim, dtype=torch.float32)
    lib.kvgrid_add_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), h.data_ptr(), rows, dim, eps,
    )  # fmt: skip
    return out, h


def supports_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` takes these: 2-D float32 CPU rows, a float32 weight of their width, a residual of
    their shape and dtype."""
    return (
        x.dtype is torch.float32
        and x.dim() == 2
        and x.device.type == "cpu"
        and weight.dtype is torch.float32
        and weight.shape[0] == x.shape[1]
        and weight.is_contiguous()
        and (residual is None or (residual.dtype is torch.float32 and residual.shape == x.shape))
    )
