"""Block hashing: the one function the router and the workers share.

A full block's key is ``H(parent_key || token ids of the block)``; the first block's parent is the tenant's
root key. Equal keys therefore mean equal tokens *and* an equal whole prefix. Keys are plain ``bytes`` and
depend only on their inputs (no ``PYTHONHASHSEED``, no machine endianness), so every process on every machine
computes the same ones.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

import numpy as np
import xxhash

HASH_ALGOS = ("xxh3_128", "sha256")

_ROOT_DOMAIN = b"kvgrid/tenant-root/v1\x00"


def _check_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")


def key_size(algo: str) -> int:
    """Bytes in one block key for ``algo``."""
    _check_algo(algo)
    return 16 if algo == "xxh3_128" else 32


def new_secret() -> bytes:
    """A fresh random server secret (32 bytes)."""
    return os.urandom(32)


def tenant_root_key(secret: bytes | str, tenant: str, algo: str = "xxh3_128") -> bytes:
    """The parent key of a tenant's first block: HMAC-SHA256(secret, tenant), cut to the key size.

    It is a keyed hash so that nobody without the server secret can compute another tenant's keys, and
    two tenants never share a root (and so never share a block).
    """
    _check_algo(algo)
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ValueError("the server secret must not be empty")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    mac = hmac.new(secret, _ROOT_DOMAIN + tenant.encode(), hashlib.sha256).digest()
    return mac[: key_size(algo)]


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes,
    algo: str = "xxh3_128",
    start_block: int = 0,
) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent`` is the key of block ``start_block - 1`` (the tenant root key when ``start_block`` is 0).
    A trailing partial block gets no key.
    """
    _check_algo(algo)
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    n_full = len(token_ids) // block_size
    if start_block >= n_full:
        return []
    data = memoryview(_token_bytes(token_ids[start_block * block_size : n_full * block_size]))
    step = 4 * block_size
    keys: list[bytes] = []
    if algo == "xxh3_128":
        digest = xxhash.xxh3_128_digest
        for off in range(0, len(data), step):
            parent = digest(parent + data[off : off + step])
            keys.append(parent)
    else:
        for off in range(0, len(data), step):
            parent = hashlib.sha256(parent + data[off : off + step]).digest()
            keys.append(parent)
    return keys
