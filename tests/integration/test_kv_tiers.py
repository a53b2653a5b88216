"""KV tiers (worker/kv_tiers.py): blocks evicted from a small pool come back from host RAM and disk with the same
greedy output, count as cached, survive a new engine on the same directory and secret, and a foreign, planted,
corrupted or truncated file is a miss, never a wrong answer."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from common.config import ConfigError, ServeConfig
from common.events import AllCleared, BlockRemoved, BlockStored, ListSink, Tier
from common.hashing import block_keys, tenant_root_key
from common.sampling import SamplingParams
from harness import wait_for
from worker.engine import Engine, EngineConfig
from worker.kv_tier_store import MARKER, TierStore, decode_header, encode_block, file_name, mac_key
from worker.kv_tiers import KVTiersConfig

SECRET = b"test-tiers-secret"
BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POOL = 40  # blocks: a 100-token prompt takes 7, so the fill below evicts it several times over


def make(path, tiers: KVTiersConfig | None = None, secret: bytes = SECRET, sink: ListSink | None = None) -> Engine:
    cfg = EngineConfig(model=str(path), device="cpu", num_blocks=POOL, secret=secret, kv_tiers=tiers or KVTiersConfig())
    return Engine(cfg, event_sink=sink)


def host_only() -> KVTiersConfig:
    return KVTiersConfig(host_bytes=16 * 2**20)


def with_disk(d, disk_bytes: int = 32 * 2**20) -> KVTiersConfig:
    return KVTiersConfig(host_bytes=16 * 2**20, disk_path=str(d), disk_bytes=disk_bytes)


def prompt(rng: random.Random, n: int = 100) -> list[int]:
    return [rng.randrange(5, 4000) for _ in range(n)]


def fill(engine: Engine, rng: random.Random, n: int = 12, tenant: str = "default") -> None:
    """Push every earlier prompt out of the pool (n x 7 blocks through a pool of 40)."""
    for _ in range(n):
        engine.generate([prompt(rng)], SamplingParams(max_tokens=1, temperature=0.0), tenant=tenant)


@pytest.fixture(scope="module")
def reference(demo_path):
    """Greedy outputs of an engine without tiers (the recompute), memoised."""
    plain = make(demo_path)
    memo: dict[tuple[int, ...], list[int]] = {}

    def ref(p: list[int]) -> list[int]:
        if tuple(p) not in memo:
            memo[tuple(p)] = list(plain.generate([p], GREEDY)[0].token_ids)
            plain.reset_prefix_cache()
        return memo[tuple(p)]

    return ref


def test_host_reload_same_output_and_cached(demo_path, reference):
    rng = random.Random(1)
    sink = ListSink()
    eng = make(demo_path, host_only(), sink=sink)
    first = prompt(rng)
    out = eng.generate([first], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(first)
    keys = block_keys(first, BS, tenant_root_key(SECRET, "default"))
    fill(eng, rng)
    events = sink.drain()
    removed_gpu = {k for e in events if isinstance(e, BlockRemoved) and e.tier is Tier.GPU for k in e.keys}
    stored_host = {k for e in events if isinstance(e, BlockStored) and e.tier is Tier.HOST for k in e.keys}
    assert set(keys) <= removed_gpu and set(keys) <= stored_host  # evicted from the pool, landed in host RAM
    again = eng.generate([first], GREEDY)[0]
    assert again.token_ids == reference(first)
    assert again.num_cached_tokens == 6 * BS  # every full block but the one holding the last prompt token
    st = eng.stats()
    assert st.host_hit_blocks >= 6 and st.tier_load_bytes > 0 and st.kv_tiers["host"].loads >= 6
    assert st.prefix_cache["default"].hit_tokens >= 6 * BS
    # Loaded blocks are GPU blocks again (published as such), and not written to host RAM a second time.
    later = sink.drain()
    assert any(isinstance(e, BlockStored) and e.tier is Tier.GPU and keys[0] in e.keys for e in later)
    assert not any(isinstance(e, BlockStored) and e.tier is Tier.HOST and keys[0] in e.keys for e in later)


def test_disk_survives_new_engine(demo_path, reference, tmp_path):
    rng = random.Random(2)
    evicted, resident = prompt(rng), prompt(rng)
    eng = make(demo_path, with_disk(tmp_path))
    eng.generate([evicted], GREEDY)
    fill(eng, rng)
    eng.generate([resident], GREEDY)  # still in the pool at close: written down then
    eng.close()
    sink = ListSink()
    eng2 = make(demo_path, with_disk(tmp_path), sink=sink)
    events = sink.drain()
    assert isinstance(events[0], AllCleared)
    on_disk = {k for e in events[1:] if isinstance(e, BlockStored) and e.tier is Tier.DISK for k in e.keys}
    root = tenant_root_key(SECRET, "default")
    for p in (evicted, resident):
        assert set(block_keys(p, BS, root)) <= on_disk
        out = eng2.generate([p], GREEDY)[0]
        assert out.token_ids == reference(p)
        assert out.num_cached_tokens == 6 * BS
    assert eng2.stats().disk_hit_blocks >= 12
    # Another secret: other keys, nothing found (and nothing wrong).
    eng2.close()
    other = make(demo_path, with_disk(tmp_path), secret=b"another-secret")
    out = other.generate([evicted], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(evicted)
    other.close()


def _written(demo_path, tmp_path, p: list[int], tenant: str = "default"):
    """Compute ``p`` for ``tenant`` on an engine with a disk tier, write it down; returns (rank dir, keys)."""
    eng = make(demo_path, with_disk(tmp_path))
    eng.generate([p], GREEDY, tenant=tenant)
    eng.close()
    assert eng.runner.tiers is not None and eng.runner.tiers.dir is not None
    return eng.runner.tiers.dir, block_keys(p, BS, tenant_root_key(SECRET, tenant))


def test_planted_file_of_another_tenant_is_never_loaded(demo_path, reference, tmp_path):
    rng = random.Random(3)
    p = prompt(rng)
    d, keys_a = _written(demo_path, tmp_path, p, tenant="a")
    keys_b = block_keys(p, BS, tenant_root_key(SECRET, "b"))
    # Tenant a's files under tenant b's names (as if b's prefix were there) ...
    for ka, kb in zip(keys_a, keys_b):
        shutil.copy(d / file_name(ka), d / file_name(kb))
    # ... and one re-signed for b by someone without the server secret.
    data = (d / file_name(keys_a[0])).read_bytes()
    h = decode_header(data)
    assert h is not None
    payload = data[len(h.head) + 16 :]
    forged = encode_block(h.fingerprint, keys_b[0], None, "b", payload, mac_key(b"guessed"))
    (d / file_name(keys_b[0])).write_bytes(forged)
    eng = make(demo_path, with_disk(tmp_path))
    out = eng.generate([p], GREEDY, tenant="b")[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(p)
    assert eng.stats().disk_hit_blocks == 0
    # Tenant a still gets its own blocks.
    out = eng.generate([p], GREEDY, tenant="a")[0]
    assert out.num_cached_tokens == 6 * BS and out.token_ids == reference(p)
    eng.close()


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "foreign"])
def test_damaged_file_is_a_miss(demo_path, reference, tmp_path, damage):
    rng = random.Random(4)
    p = prompt(rng)
    d, keys = _written(demo_path, tmp_path, p)
    path = d / file_name(keys[2])
    data = bytearray(path.read_bytes())
    if damage == "corrupted":  # one payload byte flipped: found at load
        data[-100] ^= 0xFF
    elif damage == "truncated":  # cut short: dropped when the index is rebuilt
        data = data[: len(data) // 2]
    else:  # another model's (or dtype's, layout's) block, otherwise valid
        h = decode_header(bytes(data))
        assert h is not None
        data = bytearray(
            encode_block(b"\x00" * 16, h.key, h.parent, h.tenant, bytes(data[len(h.head) + 16 :]), mac_key(SECRET))
        )
    path.write_bytes(bytes(data))
    eng = make(demo_path, with_disk(tmp_path))
    out = eng.generate([p], GREEDY)[0]
    assert out.token_ids == reference(p)
    assert out.num_cached_tokens == 2 * BS  # the blocks before the damaged one
    if damage == "corrupted":
        assert eng.stats().kv_tiers["disk"].bad == 1
    eng.close()
    assert not path.exists() or path.read_bytes() != bytes(data)  # the bad file is gone (or recomputed anew)


def test_disk_stays_within_disk_bytes(demo_path, tmp_path):
    rng = random.Random(5)
    per_file = 64 * 1024 + 256
    limit = 30 * per_file
    eng = make(demo_path, with_disk(tmp_path, disk_bytes=limit))
    fill(eng, rng, n=15)  # about 100 blocks pass through a disk of 29
    eng.close()
    tiers = eng.runner.tiers
    assert tiers is not None and tiers.dir is not None
    used = tiers.disk_usage()
    files = list(tiers.dir.glob("*.kvb"))
    assert 0 < used <= limit
    assert len(files) == eng.stats().disk_blocks
    # And after a restart with a smaller limit, the oldest files go.
    eng2 = make(demo_path, with_disk(tmp_path, disk_bytes=10 * per_file))
    eng2.close()
    assert eng2.runner.tiers is not None and eng2.runner.tiers.disk_usage() <= 10 * per_file


def test_host_tier_keeps_tenant_shares(demo_path):
    """A tenant flooding the host tier evicts its own host blocks first, not another tenant's."""
    rng = random.Random(6)
    block_bytes = 4 * 2 * BS * 2 * 64 * 4
    eng = make(demo_path, KVTiersConfig(host_bytes=40 * block_bytes))
    victim = prompt(rng)
    eng.generate([victim], GREEDY, tenant="victim")
    fill(eng, rng, n=20, tenant="flooder")  # 140 blocks through a host tier of 40
    keys = block_keys(victim, BS, tenant_root_key(SECRET, "victim"))
    held = {Tier(t): set(k) for t, k in eng.kv.held_keys().items()}  # type: ignore[union-attr]
    assert set(keys[:6]) <= held[Tier.HOST] | held[Tier.GPU]


def test_config_validation():
    base = {"tenants": [{"name": "a", "api_keys": ["sk-aaaaaaaaaaaa"]}]}
    cfg = ServeConfig.model_validate(
        {**base, "kv_tiers": {"host_bytes": 1 << 20, "disk_path": "/tmp/x", "disk_bytes": 1}}
    )
    assert cfg.kv_tiers.disk_path == "/tmp/x"
    assert ServeConfig.model_validate(base).kv_tiers.host_bytes == 0  # off by default
    with pytest.raises(ValueError, match="disk_bytes"):
        ServeConfig.model_validate({**base, "kv_tiers": {"host_bytes": 1 << 20, "disk_path": "/tmp/x"}})
    with pytest.raises(ValueError, match="host_bytes"):
        ServeConfig.model_validate({**base, "kv_tiers": {"host_bytes": -1}})
    with pytest.raises(ValueError, match="host_bytes"):
        KVTiersConfig(disk_path="/tmp/x", disk_bytes=10)
    assert isinstance(EngineConfig(kv_tiers={"host_bytes": 10}).kv_tiers, KVTiersConfig)  # type: ignore[arg-type]
    assert ConfigError  # load_config wraps these errors naming the field (tests/unit/test_config.py)


def test_churn_with_small_tiers_matches_recompute(demo_path, reference, tmp_path):
    """Batches of prompts sharing prefixes through a small pool, a smaller host tier and a disk tier (evictions,
    loads, disk reads and preemptions in the same steps): every output is the recompute's."""
    rng = random.Random(7)
    block_bytes = 4 * 2 * BS * 2 * 64 * 4
    tiers = KVTiersConfig(host_bytes=24 * block_bytes, disk_path=str(tmp_path), disk_bytes=200 * block_bytes)
    eng = make(demo_path, tiers)
    shared = [prompt(rng, 96) for _ in range(4)]
    pool = [s + prompt(rng, rng.randrange(1, 100)) for s in shared for _ in range(3)]
    for round_ in range(5):
        batch = rng.sample(pool, 6)
        outs = eng.generate(batch, GREEDY)
        for p, o in zip(batch, outs):
            assert o.token_ids == reference(p), f"round {round_}: a prompt of {len(p)} tokens diverged"
    st = eng.stats()
    assert st.host_hit_blocks > 0 and st.kv_tiers["host"].stored > 0
    eng.close()
    eng2 = make(demo_path, tiers)  # the same prompts from disk
    outs = eng2.generate(pool[:4], GREEDY)
    assert all(o.token_ids == reference(p) for p, o in zip(pool[:4], outs))
    assert eng2.stats().disk_hit_blocks > 0
    eng2.close()


def test_tensor_parallel_group_reloads_and_keeps_its_disk_tier_across_a_restart(
    ray_local, demo_path, reference, tmp_path
):
    """Two ranks, each with its own host slots and block files: a host reload and, after the group restarts, a
    disk reload give the recompute's output (the group wrote its pool down when it stopped)."""
    from worker.group import GroupConfig, WorkerGroup

    cfg = EngineConfig(model=str(demo_path), device="cpu", secret=SECRET, num_blocks=POOL, kv_tiers=with_disk(tmp_path))
    group = WorkerGroup(GroupConfig("g-tiers", cfg, tp=2))
    try:
        rng = random.Random(8)
        first, second = prompt(rng), prompt(rng)
        assert group.generate(first, GREEDY).token_ids == reference(first)
        for _ in range(12):
            group.generate(prompt(rng), SamplingParams(max_tokens=1, temperature=0.0))
        again = group.generate(first, GREEDY)
        assert again.num_cached_tokens == 6 * BS and again.token_ids == reference(first)
        group.generate(second, GREEDY)  # in the pool when the group stops
        stray = tmp_path / "g-tiers" / "tp2-rank1" / file_name(b"\x01" * 16)
        stray.write_bytes(b"not a block rank 0 knows")  # rank 1 only: rank 0 never indexes it
        group.restart()
        for p in (second, first):
            out = group.generate(p, GREEDY)
            assert out.num_cached_tokens == 6 * BS and out.token_ids == reference(p)
        assert group.stats().disk_hit_blocks >= 12
        ranks = [tmp_path / "g-tiers" / f"tp2-rank{r}" for r in (0, 1)]
        assert all(len(list(d.glob("*.kvb"))) >= 12 for d in ranks)
        # Every rank keeps only what rank 0 indexed (rank 1's writer thread deletes the stray file).
        wait_for(lambda: not stray.exists(), 30, "rank 1 to delete the block file rank 0 did not index")
    finally:
        group.shutdown()


def test_pins_live_in_host_ram_and_not_in_the_gpu_pool(demo_path, reference):
    """With a host tier an explicit cache entry pins host slots, not GPU blocks: the whole pool stays for running
    requests, the pinned prefix survives a flood of the (small) host tier and reloads; the pin expires."""
    rng = random.Random(9)
    block_bytes = 4 * 2 * BS * 2 * 64 * 4
    eng = make(demo_path, KVTiersConfig(host_bytes=20 * block_bytes))
    p = prompt(rng)
    rid = eng.add_prompt(p, GREEDY, pin_tokens=6 * BS, pin_ttl_s=300)
    while eng.has_unfinished():
        eng.step()
    assert rid not in eng._seqs
    assert eng.kv.tiers is not None
    assert not eng.kv._pool.pins and len(eng.kv.tiers.host.pins) == 6
    assert eng.stats().blocks_pinned == 6
    fill(eng, rng, n=15)  # 105 blocks through a pool of 40 and a host tier of 20
    again = eng.generate([p], GREEDY)[0]
    assert again.num_cached_tokens == 6 * BS and again.token_ids == reference(p)
    assert [t for t, _, _ in eng.pinned_entries()] == ["default"]
    assert eng.kv.expire_pins(float("inf")) == 6 and not eng.kv.tiers.host.pins


def test_serve_config_reaches_the_engine_config(tmp_path):
    from router.control.serve import _engine_config

    base = {"tenants": [{"name": "a", "api_keys": ["sk-aaaaaaaaaaaa"]}]}
    tiers = {"host_bytes": 1 << 20, "disk_path": str(tmp_path), "disk_bytes": 1 << 22}
    ec = _engine_config(ServeConfig.model_validate({**base, "kv_tiers": tiers}), "demo", "secret", False)
    assert ec.kv_tiers == KVTiersConfig(1 << 20, str(tmp_path), 1 << 22)
    assert ec.kv_tiers.for_group("g/0").disk_path == str(tmp_path / "g_0")  # one directory per group
    assert not _engine_config(ServeConfig.model_validate(base), "demo", "secret", False).kv_tiers.enabled


def test_admin_metrics_read_the_tier_fields(demo_path):
    from router.gateway.admin import _GAUGES

    eng = make(demo_path, host_only())
    rng = random.Random(10)
    p = prompt(rng)
    eng.generate([p], GREEDY)
    fill(eng, rng)
    eng.generate([p], GREEDY)
    st = eng.stats()
    fields = {f for _, _, f in _GAUGES}
    assert {"host_blocks", "host_hit_blocks", "tier_load_bytes", "tier_load_seconds"} <= fields
    values = {f: getattr(st, f) for f in fields}  # every gauge reads a field the stats have
    assert values["host_blocks"] > 0 and values["host_hit_blocks"] >= 6 and values["tier_load_bytes"] > 0


def test_write_down_runs_in_bounded_rounds(demo_path, reference, tmp_path):
    rng = random.Random(11)
    p = prompt(rng)
    eng = make(demo_path, with_disk(tmp_path))
    eng.generate([p], GREEDY)  # 6 full blocks in the pool, none on disk yet
    assert eng.stats().disk_blocks == 0
    rounds = 0
    for _ in eng.kv.write_down(round_blocks=2):  # what Engine.close does, two blocks at a time
        rounds += 1
        ops = eng.kv.take_tier_ops()
        assert ops is not None and len(ops.offload) <= 2
        eng.runner.run([], kv_ops=ops)
        eng.kv.tier_step_done(0.0)
    assert rounds >= 3 and eng.stats().disk_blocks >= 6  # 6 full blocks, 2 a round
    eng.close()
    out = make(demo_path, with_disk(tmp_path)).generate([p], GREEDY)[0]
    assert out.num_cached_tokens == 6 * BS and out.token_ids == reference(p)


def test_fingerprint_covers_every_layer_and_the_layout(demo_path):
    import torch

    from worker.kv_tier_store import model_fingerprint

    r = make(demo_path).runner

    def fp(tp: int = 1, rank: int = 0) -> bytes:
        return model_fingerprint(r.mcfg, r.model, r.dtype, BS, tp, rank)

    before = fp()
    assert fp() == before  # deterministic
    params = list(r.model.state_dict().values())
    # A middle layer's weight, as a fine-tune of that layer would change. Skips weights the CPU float32 path may
    # have packed for oneDNN at start (a timed choice): their tensors are then empty (the engine fingerprints before).
    middle = next(t for t in params[len(params) // 2 :] if t.numel() > 0)
    with torch.no_grad():
        middle.view(-1)[middle.numel() // 2] += 1.0
    assert fp() != before
    assert len({fp(), fp(2, 0), fp(2, 1)}) == 3


# -- ownership of the disk folder ----------------------------------------------------------------------------------

SHAPE = (1, 2, 4, 1, 8)  # one block: [layer, k/v, token, head, dim]


def store(folder, secret: bytes = SECRET) -> TierStore:
    tiers = KVTiersConfig(host_bytes=8 * 256, disk_path=str(folder), disk_bytes=64 * 1024)
    return TierStore(tiers, SHAPE, torch.float32, torch.device("cpu"), b"f" * 16, secret)


def test_a_folder_kvgrid_does_not_own_is_refused_untouched(tmp_path):
    rank = tmp_path / "tp1-rank0"
    rank.mkdir()
    theirs = {"notes.txt": "mine", "data.kvb": "mine too", "0a1b.kvb": "looks like a block"}
    for name, text in theirs.items():
        (rank / name).write_text(text)
    with pytest.raises(ValueError, match=r"kv_tiers\.disk_path: .*tp1-rank0 holds files kvgrid did not write"):
        store(tmp_path)
    assert {p.name: p.read_text() for p in rank.iterdir()} == theirs  # nothing written, nothing deleted


def test_kvgrid_marks_its_folders_and_deletes_only_its_own_files(tmp_path):
    made = store(tmp_path / "new")  # created: marked
    assert made.dir is not None and (made.dir / MARKER).is_file()
    made.close()
    empty = tmp_path / "empty" / "tp1-rank0"
    empty.mkdir(parents=True)
    adopted = store(tmp_path / "empty")  # an empty folder is adopted
    assert (empty / MARKER).is_file()
    adopted.close()
    legacy = tmp_path / "legacy" / "tp1-rank0"  # block files from before markers: adopted too
    legacy.mkdir(parents=True)
    (legacy / file_name(b"\x02" * 16)).write_bytes(b"a stale block")
    s = store(tmp_path / "legacy")
    assert (legacy / MARKER).is_file()
    # Someone's files in a marked folder, and kvgrid's stale ones: a scan and a keep delete only kvgrid's.
    (legacy / "README").write_text("hands off")
    (legacy / "zz.kvb").write_text("not a kvgrid name")
    (legacy / "abc123.tmp").write_text("an unfinished write")
    assert s.scan() == []
    assert sorted(p.name for p in legacy.iterdir()) == sorted([MARKER, "README", "zz.kvb"])
    (legacy / file_name(b"\x03" * 16)).write_bytes(b"another stale block")
    s._writes.put(("keep", []))
    s.flush()
    assert sorted(p.name for p in legacy.iterdir()) == sorted([MARKER, "README", "zz.kvb"])
    s.close()


def test_the_engine_side_config_refuses_what_the_serve_config_refuses(tmp_path):
    for path, message in (
        ("/etc/kv", r"kv_tiers\.disk_path: must not be in the system folder /etc"),
        ("relative/kv", r"kv_tiers\.disk_path: must be an absolute path"),
        ("/", r"kv_tiers\.disk_path: must be a folder of its own"),
    ):
        with pytest.raises(ValueError, match=message):
            KVTiersConfig(host_bytes=1, disk_path=path, disk_bytes=1)
    too_much = KVTiersConfig(host_bytes=2**62)
    with pytest.raises(ValueError, match=r"kv_tiers\.host_bytes .* is more than this node's memory"):
        TierStore(too_much, SHAPE, torch.float32, torch.device("cpu"), b"f" * 16, SECRET)
