"""LoRA adapters in the engine against PEFT (transformers + peft, float32), token for token: three adapters of
different ranks and targets and the base model in one batch, eagerly and through the decode graphs' static buffers
and masked LoRA path; the KV cache kept apart per adapter; bad adapter folders refused with the problem named, the
engine serving on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.lora import AdapterError, AdapterRef, adapter_id, read_adapter
from common.protocol import Submit
from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9, 77, 1024, 3], [400, 12, 13, 14, 15, 16, 2000, 21, 22], [7, 8]]
ADAPTERS = {  # name: (rank, alpha, target modules)
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"]),
    "all": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def _generate(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def make_adapters(model_path, out_dir, specs: dict, prompts: list[list[int]]):
    """PEFT adapters with random A and B (saved to ``out_dir/<name>``), and PEFT's greedy tokens for each prompt
    under each adapter and under the base model (key None)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()

    expected = {None: [_generate(base(), p) for p in prompts]}
    folders = {}
    for i, (name, (r, alpha, targets)) in enumerate(specs.items()):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        peft_model = get_peft_model(base(), cfg).eval()
        folders[name] = out_dir / name
        peft_model.save_pretrained(str(folders[name]))
        expected[name] = [_generate(peft_model, p) for p in prompts]
    return folders, expected


@pytest.fixture(scope="module")
def adapters(demo_path, tmp_path_factory):
    return make_adapters(demo_path, tmp_path_factory.mktemp("lora"), ADAPTERS, PROMPTS)


@pytest.fixture(scope="module")
def engine(demo_path) -> Engine:
    return Engine(
        EngineConfig(model=str(demo_path), device="cpu", secret=b"lora-secret", max_loras=2, max_lora_rank=16)
    )


def _run(engine: Engine, subs: list[Submit]) -> dict[str, object]:
    ids = [engine.add_request(s) for s in subs]
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return {i: final[i] for i in ids}


def test_three_adapters_and_the_base_in_one_batch_match_peft(engine, adapters):
    folders, expected = adapters
    names = [None, *ADAPTERS]
    subs, want = [], []
    for p, prompt in enumerate(PROMPTS):  # prompt-major: requests of one adapter are not neighbours in the batch
        for name in names:
            ref = AdapterRef.of(folders[name]) if name else None
            subs.append(Submit(prompt, GREEDY, tenant="t", adapter=ref))
            want.append((name, p))
    # Three adapters over two slots: one adapter's requests wait for a slot; every one is served.
    outs = list(_run(engine, subs).values())
    for (name, p), out in zip(want, outs):
        assert out.token_ids == expected[name][p], f"adapter {name}, prompt {p}"
    for name in ADAPTERS:  # the adapters change the output (the comparison above means something)
        assert expected[name] != expected[None]
    assert len(engine.stats().lora_adapters) == 2


def test_one_batch_with_enough_slots(demo_path, adapters):
    folders, expected = adapters
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", max_loras=3, max_lora_rank=16))
    subs = [
        Submit(p, GREEDY, adapter=AdapterRef.of(folders[n]) if n else None) for n in [*ADAPTERS, None] for p in PROMPTS
    ]
    first = engine.scheduler  # every request is admitted in the first step
    ids = [engine.add_request(s) for s in subs]
    engine.step()
    assert len(first.running) == len(ids) and not first.waiting
    final = {}
    while len(final) < len(ids):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (n, p) in enumerate((n, p) for n in [*ADAPTERS, None] for p in range(len(PROMPTS))):
        assert final[ids[i]].token_ids == expected[n][p]
    assert sorted(engine.stats().lora_adapters) == sorted(adapter_id(folders[n]) for n in ADAPTERS)


def test_choices_of_a_request_keep_its_adapter(engine, adapters):
    folders, expected = adapters
    sub = Submit(PROMPTS[1], GREEDY, adapter=AdapterRef.of(folders["mlp"]), n=2)
    rid = engine.add_request(sub)
    outs = {}
    while engine.has_unfinished():
        outs.update({(o.request_id, o.index): o for o in engine.step() if o.finished})
    assert [outs[(rid, i)].token_ids for i in (0, 1)] == [expected["mlp"][1]] * 2


def test_the_cache_is_kept_apart_per_adapter(engine, adapters):
    folders, _ = adapters
    prompt = list(range(100, 140))  # two full blocks
    a, b = AdapterRef.of(folders["attn"]), AdapterRef.of(folders["mlp"])
    cached = []
    for ref in (a, b, None, a):
        out = next(iter(_run(engine, [Submit(prompt, GREEDY, tenant="cache", adapter=ref)]).values()))
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] == 32


def _bad(tmp_path, folders, edit) -> str:
    bad = tmp_path / "bad"
    shutil.copytree(folders["attn"], bad)
    edit(bad)
    return str(bad)


def _set(field, value):
    def edit(folder):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg[field] = value
        (folder / "adapter_config.json").write_text(json.dumps(cfg))

    return edit


def _infinite_weight(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    next(iter(weights.values()))[0, 0] = float("inf")
    save_file(weights, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda f: shutil.rmtree(f), "does not exist"),
        (lambda f: (f / "adapter_config.json").write_text("{not json"), "adapter_config.json is not valid JSON"),
        (_set("r", 64), r"rank r=64 must be an integer in \[1, 16\]"),
        (_set("target_modules", ["q_proj", "lm_head"]), r"target_modules \['lm_head'\] unknown"),
        (_set("target_modules", ".*proj"), "regular expression"),
        (_set("use_dora", True), "use_dora"),
        (_set("r", 8), r"has shape \[4, 256\]; this model needs \[8, 256\]"),
        (_infinite_weight, "not finite in torch.float32"),  # (the masked path would spread its NaN to other rows)
    ],
)
def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(engine, adapters, tmp_path, edit, match):
    folders, expected = adapters
    path = _bad(tmp_path, folders, edit)
    before = engine.scheduler.num_unfinished
    with pytest.raises(ValueError, match=match) as info:
        engine.add_request(Submit(PROMPTS[0], GREEDY, adapter=AdapterRef("", path)))
    assert path in str(info.value)
    assert engine.scheduler.num_unfinished == before
    out = next(iter(_run(engine, [Submit(PROMPTS[0], GREEDY, adapter=AdapterRef.of(folders["attn"]))]).values()))
    assert out.token_ids == expected["attn"][0]


def test_an_id_that_does_not_match_the_folder_is_refused(engine, adapters):
    folders, _ = adapters
    with pytest.raises(AdapterError, match="does not match the folder's content"):
        engine.add_request(Submit(PROMPTS[0], GREEDY, adapter=AdapterRef("0" * 32, str(folders["mlp"]))))


def test_read_adapter_names_the_config(adapters):
    folders, _ = adapters
    spec = read_adapter(folders["all"], 64)
    assert (spec.rank, spec.alpha, len(spec.targets), spec.scaling) == (16, 16.0, 7, 1.0)
    assert spec.id == adapter_id(folders["all"]) != adapter_id(folders["mlp"])


def test_one_slot_and_no_host_copies_reload_from_the_folder(demo_path, adapters):
    folders, expected = adapters
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", max_loras=1, max_lora_rank=16, max_cpu_loras=0))
    order = ["attn", "mlp", None, "attn", "all"]
    outs = list(
        _run(
            engine, [Submit(PROMPTS[2], GREEDY, adapter=AdapterRef.of(folders[n]) if n else None) for n in order]
        ).values()
    )
    assert [o.token_ids for o in outs] == [expected[n][2] for n in order]
    assert engine.stats().lora_adapters == [adapter_id(folders["all"])] and not engine.runner.lora.host


@pytest.mark.parametrize(
    "seq_slots, lens, mode",
    [
        ((0, 0, -1, 1), (3, 1, 2, 1), "runs"),
        ((0, 1, -1, 0, 1, 0, 2), (3, 1, 2, 1, 4, 1, 2), "padded"),  # interleaved decode-like, consecutive slots
        ((2, 0, 2, 0, -1, 2), (1, 1, 1, 2, 1, 1), "padded"),  # slots 0 and 2: the weights are gathered
        ((0, 1, 0, 2), (30, 1, 1, 1), "segments"),  # a long prefill beside short ones: no padding
        ((0, 0, 1, 1, 2, 2), (1, 1, 1, 1, 1, 1), "in place"),  # sorted by slot, equal groups: views
    ],
)
def test_the_batched_term_equals_a_per_token_product(seq_slots, lens, mode):
    from types import SimpleNamespace

    from worker.lora import LoraBatch

    torch.manual_seed(0)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    widths = [4, 8, 0]  # slot 2: an adapter that does not target this module
    a, bt = torch.randn(3, 8, 16), torch.randn(3, 8, 12)
    for s, w in enumerate(widths):  # rows past a slot's width are zero (as ModuleLora.write leaves them)
        a[s, w:], bt[s, w:] = 0, 0
    lw = SimpleNamespace(A=a, Bt=bt, width=widths)
    x, y = torch.randn(qsl[-1], 16), torch.randn(qsl[-1], 12)
    want = y.clone()
    for s, a0, b0 in zip(seq_slots, qsl, qsl[1:]):
        if s >= 0:
            w = widths[s]
            want[a0:b0] += x[a0:b0] @ lw.A[s, :w].T @ lw.Bt[s, :w]
    batch = LoraBatch(seq_slots, qsl, torch.device("cpu"))
    got = "runs" if batch.perm is None else "segments" if not batch.padded else "padded"
    assert mode == ("in place" if batch.padded and batch.identity else got)
    torch.testing.assert_close(batch.add(SimpleNamespace(lora=lw), x, y.clone()), want)


def test_a_tensor_parallel_group_loads_each_ranks_shard_and_matches_peft(ray_local, demo_path, adapters):
    from worker.group import GroupConfig, WorkerGroup

    folders, expected = adapters
    config = EngineConfig(model=str(demo_path), device="cpu", max_loras=2, max_lora_rank=16)
    group = WorkerGroup(GroupConfig("g-lora-tp2", config, tp=2))
    try:
        for name in ["all", "attn", None, "mlp"]:
            ref = AdapterRef.of(folders[name]) if name else None
            out = group.client.run(Submit(PROMPTS[0], GREEDY, adapter=ref))
            assert out.token_ids == expected[name][0], name
    finally:
        group.shutdown()


class EagerReplay:
    """A captured decode graph's stand-in on CPU: ``replay`` runs the forward it would have recorded, on the same
    static buffers, into the same output tensor."""

    def __init__(self, graphs, size: int, lora: bool, out: torch.Tensor) -> None:
        self.graphs, self.size, self.lora, self.out, self.replays = graphs, size, lora, out, 0

    def replay(self) -> None:
        self.out.copy_(self.graphs.forward(self.size, self.lora))
        self.replays += 1


def _graph_engine(demo_path, sizes: list[int]):
    """A CPU engine (Triton attention under the interpreter: it skips the padding rows' KV slot -1) whose decode
    steps go through ``DecodeGraphs`` as on CUDA, each graph replayed eagerly."""
    from worker.model_runner import DecodeGraphs

    engine = Engine(
        EngineConfig(
            model=str(demo_path), device="cpu", attention_backend="triton", num_blocks=64, max_loras=3, max_lora_rank=16
        )
    )
    runner = engine.runner
    runner.lora.allocate()  # (what EngineConfig.lora_graphs does on CUDA, before the KV cache)
    graphs = DecodeGraphs(runner, sizes, max_blocks=engine.max_model_len // engine.config.block_size)
    hidden = engine.model_config.hidden_size
    for size in sizes:
        for lora in (False, True):
            out = torch.empty(size, hidden, dtype=engine.dtype)
            graphs.graphs[(size, lora)] = (EagerReplay(graphs, size, lora, out), out)
    graphs.with_lora = True
    runner.graphs = graphs
    return engine, graphs


def test_decode_steps_through_the_graph_buffers_and_masked_lora_match_peft(demo_path, adapters):
    folders, expected = adapters
    engine, graphs = _graph_engine(demo_path, [2, 4, 16])
    names = [None, *ADAPTERS]
    subs = [Submit(p, GREEDY, adapter=AdapterRef.of(folders[n]) if n else None) for p in PROMPTS for n in names]
    outs = list(_run(engine, subs).values())
    for i, out in enumerate(outs):
        assert out.token_ids == expected[names[i % 4]][i // 4], f"adapter {names[i % 4]}, prompt {i // 4}"
    # 12 sequences padded to 16 (four rows of slot -1) through the LoRA graph; base-only steps the plain one
    assert graphs.graphs[(16, True)][0].replays == MAX_NEW - 1
    base = list(_run(engine, [Submit(p, GREEDY) for p in PROMPTS]).values())
    assert [o.token_ids for o in base] == expected[None]
    assert graphs.graphs[(4, False)][0].replays == MAX_NEW - 1


def test_a_masked_decode_step_matches_the_grouped_one(demo_path, adapters):
    from worker.lora import LoraBatch

    folders, _ = adapters
    engine, graphs = _graph_engine(demo_path, [8])
    refs = [None, "all", "attn", "mlp", "all"]
    for p, n in zip(PROMPTS + PROMPTS, refs):
        engine.add_request(Submit(p, GREEDY, adapter=AdapterRef.of(folders[n]) if n else None))
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert all(n == 1 for _, n in batch) and len(batch) == len(refs)
    runner = engine.runner
    inp = runner.prepare(batch)
    assert sorted(inp.seq_loras) == [-1, 0, 0, 1, 2]
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        assert graphs.load(inp) == 8 and graphs.lora_slots.tolist() == list(inp.seq_loras) + [-1] * 3
        masked = runner.model.compute_logits(graphs.forward(8, lora=True)[: len(refs)])
        after_masked = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        eager = LoraBatch(inp.seq_loras, inp.query_start_loc, runner.device)
        grouped = runner.model.compute_logits(runner._forward(inp, eager))
    # Float32 rounding: the masked matmuls sum over every slot's rows (zeros included) in another order (logits
    # ~30-40 here, differences ~3e-5).
    torch.testing.assert_close(masked, grouped, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(after_masked, runner.kv_cache, rtol=1e-5, atol=1e-5)


def test_serve_asks_for_lora_graphs_only_when_a_tenant_has_adapters_at_the_start(adapters):
    """Allocating every adapter slot at the start (for the LoRA decode graphs) costs GPU memory the KV cache
    would have had: only a deployment with adapters pays it."""
    from common.config import ServeConfig
    from router.control.serve import _engine_config

    folders, _ = adapters
    plain = {"name": "a", "api_keys": ["sk-aaaaaaaaaaaa"]}
    with_adapter = {"name": "b", "api_keys": ["sk-bbbbbbbbbbbb"], "adapters": {"x": str(folders["attn"])}}
    for tenants, want in (([plain], False), ([plain, with_adapter], True)):
        cfg = ServeConfig.model_validate({"tenants": tenants})
        assert _engine_config(cfg, "demo", "secret", False).lora_graphs is want
