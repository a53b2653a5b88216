"""worker/layers/linear.py: the oneDNN fast path and its fallback to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import linear as linear_mod


def test_a_failing_onednn_op_falls_back_to_f_linear_once_and_for_all(monkeypatch):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("mkldnn linear not supported here")

    monkeypatch.setattr(linear_mod, "_onednn_linear", broken)
    monkeypatch.setattr(linear_mod, "_use_onednn", None)
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((3, 8), (5, 8), (5,)))
    torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(linear_mod.linear(x, w), F.linear(x, w))
    assert len(calls) == 1 and linear_mod._use_onednn is False  # decided at the first call, not retried


def test_a_working_onednn_op_is_kept_and_matches_f_linear(monkeypatch):
    if linear_mod._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear: F.linear is all there is")
    monkeypatch.setattr(linear_mod, "_use_onednn", None)
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((4, 16), (7, 16), (7,)))
    torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert linear_mod._use_onednn is True
