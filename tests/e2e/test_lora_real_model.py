"""LoRA adapters on SmolLM2-135M-Instruct (``model: smollm2``) against PEFT over transformers reading the same
GGUF file (float32): three adapters of different ranks and targets and the base model in one batch, greedy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]
MAX_NEW = 12
ADAPTERS = {  # name: (rank, alpha, target modules)
    "attn": (8, 32, ["q_proj", "v_proj", "o_proj"]),
    "mlp": (4, 8, ["gate_proj", "up_proj", "down_proj"]),
    "all": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from worker.models.registry import resolve_model

    return resolve_model("smollm2", progress=False)


@pytest.fixture(scope="module")
def reference(smollm2: Path, tmp_path_factory):
    """The prompts, the adapters' folders and PEFT's greedy tokens per adapter (None: the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.cache import cache_root
    from worker.models.registry import PACKAGED

    gguf = cache_root() / "downloads" / PACKAGED["smollm2"].filename
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    # Read (and dequantized) once; each adapter wraps a copy of it.
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    def base():
        return copy.deepcopy(loaded)

    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False).input_ids)

    def greedy(model) -> list[list[int]]:
        outs = []
        for ids in prompts:
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
                )
            outs.append(gen[0, len(ids) :].tolist())
        return outs

    expected = {None: greedy(loaded)}
    folders = {}
    out_dir = tmp_path_factory.mktemp("lora-smollm2")
    for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(7 + i)
        model = get_peft_model(
            base(), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        )
        folders[name] = out_dir / name
        model.save_pretrained(str(folders[name]))
        expected[name] = greedy(model.eval())
    return prompts, folders, expected


def test_three_adapters_and_the_base_in_one_batch_match_peft(smollm2: Path, reference) -> None:
    from common.lora import AdapterRef
    from common.protocol import Submit
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    prompts, folders, expected = reference
    engine = Engine(EngineConfig(model=str(smollm2), device="cpu", max_loras=3, max_lora_rank=16))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    names = [None, *ADAPTERS]
    want, ids = [], []
    for p, prompt in enumerate(prompts):
        for name in names:
            ref = AdapterRef.of(folders[name]) if name else None
            ids.append(engine.add_request(Submit(prompt, params, adapter=ref)))
            want.append(expected[name][p])
    final = {}
    while len(final) < len(ids):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[i].token_ids for i in ids] == want
    assert any(expected[name] != expected[None] for name in ADAPTERS)  # the adapters matter
