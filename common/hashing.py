"""Block hashing: the one function the router and the workers share.

A full block's key is ``H(parent_key || token ids of the block)``; the first block's parent is the tenant's
root key. Equal keys therefore mean equal tokens *and* an equal whole prefix. Keys are plain ``bytes`` and
depend only on their inputs (no ``PYTHONHASHSEED``, no machine endianness), so every process on every machine
computes the same ones.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import xxhash

HASH_ALGOS = ("xxh3_128", "sha256")

_ROOT_DOMAIN = b"kvgrid/tenant-root/v1\x00"
# A root under a LoRA adapter: its own domain (no message under it equals a plain tenant's) and the tenant's length
# before it, so no (tenant, adapter) pair reads as another.
_ADAPTER_ROOT_DOMAIN = b"kvgrid/tenant-lora-root/v1\x00"


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


def tenant_root_key(secret: bytes | str, tenant: str, algo: str = "xxh3_128", adapter: str | None = None) -> bytes:
    """The parent key of a tenant's first block: HMAC-SHA256(secret, tenant), cut to the key size.

    It is a keyed hash so that nobody without the server secret can compute another tenant's keys, and
    two tenants never share a root (and so never share a block). With ``adapter`` (a LoRA adapter's id) the
    HMAC covers the tenant and the adapter: blocks computed under one adapter never match the base model's or
    another adapter's.
    """
    _check_algo(algo)
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ValueError("the server secret must not be empty")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    if adapter is None:
        msg = _ROOT_DOMAIN + tenant.encode()
    else:
        if not isinstance(adapter, str) or not adapter:
            raise ValueError("adapter must be a non-empty string (an adapter id) or None")
        name = tenant.encode()
        msg = _ADAPTER_ROOT_DOMAIN + len(name).to_bytes(4, "big") + name + adapter.encode()
    mac = hmac.new(secret, msg, hashlib.sha256).digest()
    return mac[: key_size(algo)]


class RootKeys:
    """The root keys of every tenant (and LoRA adapter under it) seen so far under one secret and hash algorithm,
    each computed once (the router and the engine ask for one per request). Server side only: a root key is never
    sent to a client."""

    def __init__(self, secret: bytes | str, algo: str = "xxh3_128") -> None:
        self.secret, self.algo = secret, algo
        self._keys: dict[tuple[str, str | None], bytes] = {}

    def __call__(self, tenant: str, adapter: str | None = None) -> bytes:
        key = self._keys.get((tenant, adapter))
        if key is None:
            key = self._keys[(tenant, adapter)] = tenant_root_key(self.secret, tenant, self.algo, adapter)
        return key


def token_array(token_ids: Sequence[int]) -> array.array:
    """Token ids as an ``array('I')`` (C unsigned int: 4 bytes on every platform we run on). The gateways send the
    router replicas prompts as one: it crosses processes as one buffer, and ``token_bytes`` copies it as it is
    instead of converting each id."""
    if isinstance(token_ids, array.array) and token_ids.typecode == "I":
        return token_ids
    try:
        return array.array("I", token_ids)
    except OverflowError:
        raise ValueError("token ids must lie in [0, 2**32)") from None


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (what block keys hash)."""
    arr = token_array(token_ids)
    if sys.byteorder == "big":
        arr = array.array("I", arr)
        arr.byteswap()
    return arr.tobytes()


class ChunkKeyCache:
    """Remembers the keys of recently hashed chunks, by a digest of (parent key, chunk tokens): prompts that
    come back (a conversation's next turn, a shared system prompt) skip rehashing their prefix. A digest
    collision could only misdirect routing, never change what a worker computes (workers hash for themselves).
    """

    def __init__(self, max_chunks: int = 8192) -> None:
        self.max_chunks = max_chunks
        # Tuples of bytes: the garbage collector stops tracking them, so a large cache costs no GC time.
        self._chunks: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()

    def get(self, tag: bytes) -> tuple[bytes, ...] | None:
        keys = self._chunks.get(tag)
        if keys is not None:
            self._chunks.move_to_end(tag)
        return keys

    def put(self, tag: bytes, keys: Sequence[bytes]) -> None:
        self._chunks[tag] = tuple(keys)
        if len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)


def iter_key_chunks(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes,
    algo: str = "xxh3_128",
    start_block: int = 0,
    chunk_blocks: int = 64,
    cache: ChunkKeyCache | None = None,
) -> Iterator[Sequence[bytes]]:
    """Chained keys of the full blocks of ``token_ids`` from block ``start_block`` on, computed lazily,
    ``chunk_blocks`` at a time (a caller that stops early, like the router at the first block no group holds,
    hashes no more).

    ``parent`` is the key of block ``start_block - 1`` (the tenant root key when ``start_block`` is 0).
    A trailing partial block gets no key.
    """
    _check_algo(algo)
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    n_full = len(token_ids) // block_size
    step = 4 * block_size
    digest = xxhash.xxh3_128_digest if algo == "xxh3_128" else _sha256
    for first in range(start_block, n_full, chunk_blocks):
        last = min(first + chunk_blocks, n_full)
        data = token_bytes(token_ids[first * block_size : last * block_size])
        chunk: Sequence[bytes] | None = None
        if cache is not None:
            tag = xxhash.xxh3_128_digest(b"%s:%d:" % (algo.encode(), block_size) + parent + data)
            chunk = cache.get(tag)
            if chunk is None:
                chunk = _chain(digest, parent, data, step)
                cache.put(tag, chunk)
        else:
            chunk = _chain(digest, parent, data, step)
        parent = chunk[-1]
        yield chunk


def _chain(digest: Callable[[bytes], bytes], parent: bytes, data: bytes, step: int) -> list[bytes]:
    """The chained keys of the blocks in ``data`` (``step`` bytes each), the first chained to ``parent``."""
    keys = []
    for off in range(0, len(data), step):
        parent = digest(parent + data[off : off + step])
        keys.append(parent)
    return keys


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes,
    algo: str = "xxh3_128",
    start_block: int = 0,
) -> list[bytes]:
    """All chained full-block keys (see ``iter_key_chunks``)."""
    return [k for c in iter_key_chunks(token_ids, block_size, parent, algo, start_block, 1 << 30) for k in c]
