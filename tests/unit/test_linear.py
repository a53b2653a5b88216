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


def _two_layers() -> torch.nn.Module:
    layers = torch.nn.Sequential(linear_mod.ColumnParallelLinear(64, 128), linear_mod.ColumnParallelLinear(128, 64))
    for m in layers:
        m.weight.data.normal_()
    return layers


def test_the_float32_path_is_the_fastest_of_f_linear_onednn_and_packed_on_the_models_weights(monkeypatch):
    if linear_mod._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear: F.linear is all there is")
    import time
    import types

    real_onednn, real_linear = linear_mod._onednn_linear, F.linear
    calls = []

    def slow_onednn(*args):  # both oneDNN ways slow
        calls.append(args[1].shape)
        time.sleep(0.002)
        return real_onednn(*args)

    monkeypatch.delenv("KVGRID_CPU_LINEAR", raising=False)
    monkeypatch.setattr(linear_mod, "_onednn_linear", slow_onednn)
    monkeypatch.setattr(linear_mod, "_use_onednn", None)
    assert linear_mod.pick_float32_path(_two_layers()) == "torch"
    assert {tuple(s) for s in calls} == {(128, 64), (64, 128)}  # each of the model's weights was timed
    calls.clear()
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    torch.testing.assert_close(linear_mod.linear(x, w), F.linear(x, w))
    assert not calls  # from now on F.linear computes

    def slow_dense_onednn(*args):  # oneDNN slow from a dense weight only: packing pays
        if not args[1].is_mkldnn:
            time.sleep(0.002)
        return real_onednn(*args)

    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        monkeypatch.setattr(linear_mod, "_onednn_linear", slow_dense_onednn)
        slow = types.SimpleNamespace(linear=lambda *a: time.sleep(0.002) or real_linear(*a))
        monkeypatch.setattr(linear_mod, "F", slow)
        monkeypatch.setattr(linear_mod, "_use_onednn", None)
        assert linear_mod.pick_float32_path(_two_layers()) == "packed"
        assert linear_mod._use_onednn is True

    def slow_linear(*args):
        time.sleep(0.002)
        return real_linear(*args)

    monkeypatch.setattr(linear_mod, "_onednn_linear", real_onednn)
    monkeypatch.setattr(linear_mod, "F", types.SimpleNamespace(linear=slow_linear))
    monkeypatch.setattr(linear_mod, "_use_onednn", None)
    assert linear_mod.pick_float32_path(_two_layers()) in ("onednn", "packed")
    assert linear_mod._use_onednn is True


def test_kvgrid_cpu_linear_decides_without_timing_and_a_bad_value_says_what_is_allowed(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_mod, "_onednn_linear", lambda *a: calls.append(a))
    for value, onednn in (("torch", False), ("onednn", True), ("packed", True)):
        monkeypatch.setenv("KVGRID_CPU_LINEAR", value)
        monkeypatch.setattr(linear_mod, "_use_onednn", None)
        assert linear_mod.pick_float32_path(_two_layers()) == value and linear_mod._use_onednn is onednn
    assert not calls
    monkeypatch.setenv("KVGRID_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KVGRID_CPU_LINEAR must be auto, packed, onednn or torch, not 'mkl'"):
        linear_mod.pick_float32_path(_two_layers())


def _packed(engine) -> list[str]:
    return [n for n, p in engine.runner.model.named_parameters() if getattr(p, "packed", None) is not None]


@pytest.mark.parametrize("variant", ["demo", "demo:qwen2"])  # qwen2's LM head is tied to its embedding
def test_bfloat16_engines_pack_their_linears_and_compute_what_the_dense_weights_do(variant, monkeypatch):
    import random

    import worker.engine as engine_mod
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    if linear_mod._onednn_linear is None or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN linear: nothing is packed")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # an AVX2-only CPU: oneDNN refuses bfloat16 weights
        assert not _packed(Engine(EngineConfig(model=variant, device="cpu", dtype="bfloat16", num_blocks=64)))
        pytest.skip("this CPU has no oneDNN bfloat16 path: nothing is packed (checked), nothing to compare")
    config = EngineConfig(model=variant, device="cpu", dtype="bfloat16", num_blocks=64)
    packed = Engine(config)
    model = packed.runner.model
    names = _packed(packed)
    tied = model.cfg.tie_word_embeddings
    layers = model.cfg.num_layers
    assert len(names) == 4 * layers + (0 if tied else 1), names  # qkv, o, gate_up, down per layer (+ the head)
    assert ("lm_head.weight" in names) == (not tied)
    params = dict(model.named_parameters())
    assert all(params[n].numel() == 0 for n in names)  # the dense copies are gone
    assert model.model.embed_tokens.weight.numel() > 0
    monkeypatch.setattr(engine_mod, "pack_linear_weights", lambda m: 0)
    dense = Engine(config)
    assert not _packed(dense)
    rng = random.Random(3)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    for a, b in zip(packed.generate(prompts, params), dense.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-3)


def test_float32_engines_with_packed_linears_compute_what_f_linear_does(monkeypatch):
    """``KVGRID_CPU_LINEAR=packed``: every linear weight is packed (the dense copies dropped) and the engine
    generates the tokens ``F.linear`` does, logprobs within float32 rounding; ``torch`` packs nothing."""
    import random

    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    if linear_mod._onednn_linear is None or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN linear: nothing is packed")
    config = EngineConfig(model="demo", device="cpu", dtype="float32", num_blocks=64)
    monkeypatch.setenv("KVGRID_CPU_LINEAR", "packed")
    monkeypatch.setattr(linear_mod, "_use_onednn", None)
    packed = Engine(config)
    names = _packed(packed)
    assert len(names) == 4 * packed.runner.model.cfg.num_layers + 1, names  # qkv, o, gate_up, down; the head
    assert packed.runner.linear_path == "packed"
    rng = random.Random(5)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    got = packed.generate(prompts, params)
    monkeypatch.setenv("KVGRID_CPU_LINEAR", "torch")
    dense = Engine(config)
    assert not _packed(dense) and dense.runner.linear_path == "torch"
    for a, b in zip(got, dense.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_a_packing_probe_that_disagrees_packs_nothing(monkeypatch):
    if linear_mod._onednn_linear is None or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN linear")
    layer = linear_mod.ColumnParallelLinear(16, 8).to(torch.bfloat16)
    layer.weight.data.normal_()
    real = linear_mod._onednn_linear
    monkeypatch.setattr(linear_mod, "_onednn_linear", lambda x, w, *a: real(x, w, *a) + 1)  # a wrong kernel
    assert linear_mod.pack_linear_weights(torch.nn.Sequential(layer)) == 0
    assert getattr(layer.weight, "packed", None) is None and layer.weight.numel() == 16 * 8
