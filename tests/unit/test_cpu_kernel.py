"""worker/attention/cpu_kernel.py: the C decode kernel is built once per machine and cached, reads the blocks in
place (long contexts, wide heads, a query that is a view), and the engine falls back to torch without a compiler."""

from __future__ import annotations

import logging

import pytest
import torch

from worker.attention import cpu_kernel


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel module with nothing loaded yet, building into its own cache directory."""
    monkeypatch.setattr(cpu_kernel, "_lib", None)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setenv("KVGRID_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("KVGRID_CPU_ATTENTION", raising=False)
    return tmp_path


# `make test` installs one (system-tools) where it can, as it does rsync
needs_cc = pytest.mark.skipif(cpu_kernel.find_compiler() is None, reason="no C compiler here")


def reference(q, k_cache, v_cache, tables, lens, scale):
    n, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        t = tables[i, : -(-int(lens[i]) // k_cache.shape[1])].long()
        k = k_cache[t].flatten(0, 1)[: lens[i]].double()
        v = v_cache[t].flatten(0, 1)[: lens[i]].double()
        for h in range(heads):
            p = torch.softmax(k[:, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ v[:, h // group]
    return out


@needs_cc
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 64, 16), (8, 1, 128, 8), (6, 6, 32, 32)])
def test_the_kernel_matches_a_float64_reference(fresh, dtype, tol, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * head_dim)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 300, 64 * 3 + 5], dtype=torch.int32)  # across chunks too
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * width + 4
    # stale blocks and slots past each row's end hold huge values: reading one would show
    k_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 1e4).to(dtype)
    v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 1e4).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    for i, n in enumerate(lens.tolist()):
        for p in range(n):
            b, o = int(tables[i, p // block_size]), p % block_size
            k_cache[b, o] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
            v_cache[b, o] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
    # q as the model makes it: a view into a wider row (Q beside K in the fused projection)
    fused = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g).to(dtype)
    q = fused[:, :heads]
    assert not q.is_contiguous()
    lib = cpu_kernel.load()
    assert lib is not None
    out = cpu_kernel.paged_decode(lib, q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.2e}"
    # a one-key row is exactly that key's value
    torch.testing.assert_close(out[0].float(), v_cache[tables[0, 0], 0].float().repeat_interleave(heads // kv_heads, 0))


@needs_cc
def test_the_build_is_cached_and_reused(fresh):
    assert cpu_kernel.load() is not None
    built = list(fresh.glob("cpu_decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    cpu_kernel._tried, cpu_kernel._lib = False, None  # as a new process would
    assert cpu_kernel.load() is not None
    assert list(fresh.glob("*")) == built and built[0].stat().st_mtime_ns == mtime


def test_without_a_compiler_attention_falls_back_to_torch(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="kvgrid.worker"):
        assert cpu_kernel.load() is None
    assert "using the torch path" in caplog.text
    # and the backend then decodes through torch, correctly
    from tests.unit.test_torch_attention import DECODES, run

    decodes = run(DECODES, 2, 2, torch.float32)
    assert decodes.tables is None


@needs_cc
def test_a_missing_source_is_warned_about_once_naming_the_file(fresh, monkeypatch, caplog):
    gone = fresh / "cpu_norm.c"  # as an install without the package data would have it
    monkeypatch.setattr(cpu_kernel, "SOURCES", (cpu_kernel.SOURCES[0], gone))
    with caplog.at_level(logging.WARNING, logger="kvgrid.worker"):
        assert cpu_kernel.load() is None
        assert cpu_kernel.load() is None  # the engine's norms and attention each ask: one warning in all
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"source missing from the install: {gone}" in warnings[0]
    assert "using the torch path" in warnings[0]
    assert not list(fresh.glob("*.so"))


def test_native_makes_a_missing_kernel_an_error_and_torch_never_builds_it(fresh, monkeypatch):
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", "torch")
    assert cpu_kernel.load() is None
    assert not list(fresh.glob("*"))
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", "native")
    with pytest.raises(RuntimeError, match="KVGRID_CPU_ATTENTION=native"):
        cpu_kernel.load()
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="KVGRID_CPU_ATTENTION must be auto, native or torch, not 'fast'"):
        cpu_kernel.load()


@needs_cc
@pytest.mark.parametrize("rows,dim", [(1, 256), (8, 256), (5, 4096), (3, 37)])  # 37: no whole vector register
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_runs_through_the_kernel_and_matches_a_float64_reference(fresh, monkeypatch, rows, dim, with_residual):
    from worker.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=g)
    x = torch.randn(rows, dim, generator=g) * 30  # large sums of squares
    residual = torch.randn(rows, dim, generator=g) if with_residual else None
    x_before, residual_before = x.clone(), None if residual is None else residual.clone()
    calls = []
    real = cpu_kernel.add_rms_norm

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(cpu_kernel, "add_rms_norm", spy)
    out, h = norm(x, residual)
    assert len(calls) == 1
    h_ref = x.double() + (0 if residual is None else residual.double())
    ref = norm.weight.double() * h_ref / torch.sqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert out.dtype == torch.float32 and out.shape == (rows, dim)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(h, x if residual is None else x + residual, rtol=0, atol=0)  # the next residual
    # inputs are left as they were
    assert torch.equal(x, x_before) and (residual is None or torch.equal(residual, residual_before))


@needs_cc
def test_rms_norm_leaves_what_the_kernel_does_not_take_to_torch(fresh, monkeypatch):
    from worker.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    monkeypatch.setattr(cpu_kernel, "add_rms_norm", lambda *a: pytest.fail("the kernel took a tensor it cannot"))
    x = torch.randn(2, 3, 64)  # 3-D
    out, h = norm(x)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))
    xb = torch.randn(4, 64).to(torch.bfloat16)  # a bfloat16 model's rows
    out, _ = norm.to(torch.bfloat16)(xb, xb)
    assert out.dtype == torch.bfloat16
    # and KVGRID_CPU_ATTENTION=torch keeps a new module off the kernels altogether
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", "torch")
    plain = RMSNorm(64, 1e-6)
    out, _ = plain(torch.randn(4, 64))
    assert plain._lib is False
