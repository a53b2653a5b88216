"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from common import env, native


@pytest.fixture(params=["native", "numpy"])
def key_table_path(request, monkeypatch):
    """The compact index's key table on its C operations (router/routing/keytable.c), then on its numpy and Python
    paths (``KVGRID_INDEX_NATIVE``): a test that uses it runs on both."""
    if request.param == "native" and native.find_compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv(env.INDEX_NATIVE.name, request.param)
    return request.param
