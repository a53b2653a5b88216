"""worker/attention/torch_backend.py against a float64 reference: decodes on each of its paths (the CPU kernel that
reads the blocks in place; with it off, SDPA, and the wide batched matmuls that bfloat16 on the CPU takes with one
or two KV heads), alone and beside prefills, over shuffled blocks whose unused slots hold stale values (finite
garbage, as a reused cache block does)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_triton_attention import TOL, make_batch, reference, rel_err
from worker.attention import cpu_kernel
from worker.attention.torch_backend import TorchBackend

# (context before, new tokens): decodes over ragged contexts, some ending inside a block, one of a single token
DECODES = [(0, 1), (5, 1), (16, 1), (37, 1), (63, 1), (64, 1), (100, 1)]
MIXED = [(37, 1), (0, 9), (5, 1), (20, 12), (63, 1)]


def run(seqs, kv_heads, group, dtype, seed=0):
    q, kc, vc, md, ks, vs, nk, nv = make_batch(seqs, 16, kv_heads, group, 32, dtype, seed)
    stale = torch.isnan(kc)
    g = torch.Generator().manual_seed(seed + 1)
    kc[stale] = (torch.randn(int(stale.sum()), generator=g) * 30).to(dtype)  # large: a leak would show
    vc[torch.isnan(vc)] = (torch.randn(int(stale.sum()), generator=g) * 30).to(dtype)
    backend = TorchBackend()
    backend.write_kv(nk, nv, kc, vc, md)
    scale = 32**-0.5
    out = backend.forward(q, kc, vc, md, scale)
    decodes, _ = md.scratch["torch"]
    err = rel_err(out, reference(q, ks, vs, seqs, scale))
    assert err <= TOL[dtype], f"relative error {err:.2e}"
    return decodes


@pytest.mark.parametrize("seqs", [DECODES, MIXED], ids=["decode-only", "mixed"])
@pytest.mark.parametrize("kv_heads,group", [(1, 4), (2, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_decodes_match_the_reference_on_every_path(seqs, kv_heads, group, dtype, kernel, monkeypatch):
    if kernel == "native" and cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU decode kernel cannot be built")
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", kernel)
    decodes = run(seqs, kv_heads, group, dtype)
    assert (decodes.tables is not None) == (kernel == "native")
    assert decodes.wide == (
        kernel == "torch" and dtype == torch.bfloat16 and kv_heads <= TorchBackend.wide_max_kv_heads
    )


def test_the_wide_path_masks_the_other_heads_keys_and_what_lies_past_each_row(monkeypatch):
    monkeypatch.setenv("KVGRID_CPU_ATTENTION", "torch")
    q, kc, vc, md, ks, vs, nk, nv = make_batch(DECODES, 16, 2, 2, 32, torch.bfloat16)
    kc[torch.isnan(kc)], vc[torch.isnan(vc)] = 0.0, 0.0
    backend = TorchBackend()
    backend.write_kv(nk, nv, kc, vc, md)
    out = backend.forward(q, kc, vc, md, 32**-0.5)
    decodes, _ = md.scratch["torch"]
    assert decodes.wide
    # every value of KV head 1 made huge: query heads 0-1 (KV head 0) must not move, heads 2-3 must
    vc2 = vc.clone()
    vc2[:, :, 1] += 1000.0
    md.scratch.clear()
    out2 = backend.forward(q, kc, vc2, md, 32**-0.5)
    torch.testing.assert_close(out2[:, :2], out[:, :2])
    assert (out2[:, 2:] - out[:, 2:]).abs().min() > 100
