from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from common import hashing
from common.hashing import RootKeys, block_keys, key_size, tenant_root_key

TOKENS = list(range(1000, 1070))  # 4 full blocks of 16 and 6 tokens over


def test_keys_cover_full_blocks_only():
    root = tenant_root_key(b"secret", "acme")
    assert len(block_keys(TOKENS, 16, root)) == 4
    assert block_keys(TOKENS[:15], 16, root) == []


def test_key_is_hash_of_parent_key_and_little_endian_token_ids():
    root = tenant_root_key(b"secret", "acme")
    keys = block_keys(TOKENS, 16, root)
    parent = root
    for i, key in enumerate(keys):
        data = np.asarray(TOKENS[i * 16 : (i + 1) * 16], dtype="<u4").tobytes()
        assert key == xxhash.xxh3_128_digest(parent + data)
        parent = key
    sha = block_keys(TOKENS, 16, tenant_root_key(b"secret", "acme", "sha256"), "sha256")
    assert len(sha[0]) == key_size("sha256") == 32
    assert sha[1] == hashlib.sha256(sha[0] + np.asarray(TOKENS[16:32], dtype="<u4").tobytes()).digest()


def test_root_key_is_hmac_of_tenant_under_server_secret():
    expected = hmac.new(b"secret", b"kvgrid/tenant-root/v1\x00acme", hashlib.sha256).digest()[:16]
    assert tenant_root_key(b"secret", "acme") == expected
    assert tenant_root_key(b"other-secret", "acme") != expected


def test_same_block_after_a_different_prefix_gets_a_different_key():
    root = tenant_root_key(b"s", "t")
    a = block_keys([1] * 16 + [7] * 16, 16, root)
    b = block_keys([2] * 16 + [7] * 16, 16, root)
    assert a[0] != b[0] and a[1] != b[1]


def test_second_tenant_gets_disjoint_keys_for_the_same_tokens():
    a = block_keys(TOKENS, 16, tenant_root_key(b"s", "acme"))
    b = block_keys(TOKENS, 16, tenant_root_key(b"s", "globex"))
    assert not set(a) & set(b)


def test_incremental_hashing_continues_the_chain():
    root = tenant_root_key(b"s", "t")
    full = block_keys(TOKENS, 16, root)
    assert block_keys(TOKENS, 16, full[1], start_block=2) == full[2:]


def test_keys_do_not_depend_on_the_process_or_hash_seed():
    code = (
        "from common.hashing import block_keys, tenant_root_key;"
        "print(block_keys(list(range(1000, 1070)), 16, tenant_root_key(b'secret', 'acme'))[-1].hex())"
    )
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.add(run.stdout)
    assert seen == {block_keys(TOKENS, 16, tenant_root_key(b"secret", "acme"))[-1].hex() + "\n"}


@pytest.mark.parametrize(
    "call",
    [
        lambda: tenant_root_key(b"", "acme"),
        lambda: tenant_root_key(b"s", ""),
        lambda: tenant_root_key(b"s", "acme", "md5"),
        lambda: block_keys([1, 2], 0, b"x"),
        lambda: block_keys([-1] * 16, 16, b"x"),
    ],
)
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_chunk_cache_returns_the_same_keys_and_is_keyed_by_the_parent():
    from common.hashing import ChunkKeyCache, iter_key_chunks

    cache = ChunkKeyCache(max_chunks=4)
    root = tenant_root_key(b"s", "acme")
    tokens = list(range(3000))
    plain = block_keys(tokens, 16, root)
    for _ in range(2):  # cold, then from the cache
        assert [k for c in iter_key_chunks(tokens, 16, root, chunk_blocks=8, cache=cache) for k in c] == plain
    other = tenant_root_key(b"s", "globex")
    assert [k for c in iter_key_chunks(tokens, 16, other, chunk_blocks=8, cache=cache) for k in c] == block_keys(
        tokens, 16, other
    )
    assert len(cache._chunks) == 4


def test_root_keys_memo_gives_the_hmac_root_and_computes_each_tenant_once(monkeypatch):
    calls = []
    real = hashing.tenant_root_key
    monkeypatch.setattr(hashing, "tenant_root_key", lambda *a: calls.append(a[1]) or real(*a))
    roots = RootKeys("secret", "sha256")
    assert roots("acme") == real(b"secret", "acme", "sha256") and len(roots("acme")) == 32
    assert roots("globex") == real(b"secret", "globex", "sha256") != roots("acme")
    assert roots("acme") is roots("acme")
    assert calls == ["acme", "globex"]
    with pytest.raises(ValueError, match="secret"):
        RootKeys(b"")("acme")


def test_an_adapter_root_differs_from_the_base_and_from_other_adapters():
    base = tenant_root_key("s", "acme")
    a, b = tenant_root_key("s", "acme", adapter="a" * 32), tenant_root_key("s", "acme", adapter="b" * 32)
    assert len({base, a, b, tenant_root_key("s", "acme2", adapter="a" * 32)}) == 4
    assert tenant_root_key("s", "acme", adapter=None) == base
    roots = RootKeys("s")
    assert roots("acme") == base and roots("acme", "a" * 32) == a and roots("acme", None) == base


def test_a_prompt_as_an_array_hashes_like_the_list_and_out_of_range_ids_are_refused():
    from common.hashing import token_array

    tokens = [0, 1, 2**32 - 1, 70000] * 40
    as_array = token_array(tokens)
    assert as_array.typecode == "I" and token_array(as_array) is as_array
    assert block_keys(as_array, 16, b"r" * 16) == block_keys(tokens, 16, b"r" * 16)
    assert block_keys(as_array[16:], 16, b"r" * 16) == block_keys(tokens[16:], 16, b"r" * 16)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        token_array([2**32])
