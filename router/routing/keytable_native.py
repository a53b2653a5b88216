"""The key table's C operations (``keytable.c``: lookup, insertion, deletion by backward shift), built once per
machine (``common/native.py``) and called through ctypes on the table's numpy arrays.

``load()`` returns the library, or None where it cannot be had (no compiler, a failed build: one warning, logger
``kvgrid.router``) or ``KVGRID_INDEX_NATIVE=numpy``; ``KeyTable`` then runs its numpy and Python paths, which give
the same results. The C operations handle one mask word per tier (up to 64 groups); wider masks stay on numpy.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

from common import env, native

log = logging.getLogger("kvgrid.router")

SOURCES = (Path(__file__).with_name("keytable.c"),)
FLAGS = ("-O2", "-march=native")

_lib: ctypes.CDLL | None = None
_tried = False
_P, _I64, _U64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int


def load() -> ctypes.CDLL | None:
    """The key table library (built on first use), or None (see the module's docstring)."""
    global _lib, _tried
    want = env.index_native()
    if want == "numpy":
        return None
    if not _tried:
        _tried = True
        try:
            lib = ctypes.CDLL(str(native.build("keytable", SOURCES, FLAGS)))
            lib.kvgrid_kt_find.restype = None
            lib.kvgrid_kt_find.argtypes = [_P, _I64, _P, _I64, _P]  # codes, capacity, wanted, n, out
            lib.kvgrid_kt_insert.restype = _I64
            # codes, masks, mask word bytes, capacity, wanted, n, tier row, value, out
            lib.kvgrid_kt_insert.argtypes = [_P, _P, _INT, _I64, _P, _I64, _INT, _U64, _P]
            lib.kvgrid_kt_remove.restype = _I64
            # codes, masks, mask word bytes, capacity, wanted, n, tier row, value, tiered
            lib.kvgrid_kt_remove.argtypes = [_P, _P, _INT, _I64, _P, _I64, _INT, _U64, _INT]
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:  # AttributeError: a symbol missing
            detail = getattr(e, "stderr", "") or ""
            log.warning("prefix index C operations unavailable (%s%s); using numpy", e, detail[-500:])
    if _lib is None and want == "native":
        raise RuntimeError("KVGRID_INDEX_NATIVE=native, but the key table library could not be built (see the log)")
    return _lib
