"""The demo model folders load in transformers as specified, are deterministic, and give peaky greedy logits."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import statistics
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from worker.models import demo_model
from worker.models.demo_model import DEMO_VARIANTS, SPECIAL_TOKENS, write_demo_model
from worker.models.registry import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
TEXTS = (
    "Hello, world! The cache is warm at 09:41.",
    "  two leading spaces\n\n\ttab, CRLF\r\nand trailing   ",
    "def f(x: int) -> int:\n    return x ** 2  # 12345678\n",
    "Grüße aus Zürich, café crème, naïve façade",
    "東京は晴れ、Привет мир, مرحبا, 🚀🔥 and é",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: write_demo_model(tmp_path_factory.mktemp(v), v) for v in DEMO_VARIANTS}


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {v: AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval() for v, d in folders.items()}


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("variant", DEMO_VARIANTS)
def test_loads_with_no_missing_or_unexpected_keys(folders: dict[str, Path], variant: str) -> None:
    folder = folders[variant]
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert ("lm_head.weight" in keys) == (variant == "llama")
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (variant == "qwen2")


def test_config_values(folders: dict[str, Path]) -> None:
    llama, qwen = _read(folders["llama"], "config.json"), _read(folders["qwen2"], "config.json")
    assert llama["architectures"] == ["LlamaForCausalLM"] and qwen["architectures"] == ["Qwen2ForCausalLM"]
    assert (llama["num_hidden_layers"], llama["hidden_size"], llama["head_dim"]) == (4, 256, 64)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (4, 2)
    assert llama["tie_word_embeddings"] is False and llama["attention_bias"] is False
    assert llama["rope_theta"] == 10000.0 and llama["rope_scaling"]["rope_type"] == "llama3"
    assert (qwen["num_hidden_layers"], qwen["hidden_size"], qwen["head_dim"]) == (2, 128, 32)
    assert (qwen["num_attention_heads"], qwen["num_key_value_heads"]) == (4, 4)
    assert qwen["tie_word_embeddings"] is True and qwen["use_sliding_window"] is False
    assert qwen["rope_theta"] == 1000000.0 and qwen["rope_scaling"] is None
    for cfg in (llama, qwen):
        assert cfg["torch_dtype"] == "float32" and cfg["hidden_act"] == "silu"
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (0, 1, 4096)
        assert "rope_parameters" not in cfg

    # What transformers makes of it (5.x converts rope_scaling to rope_parameters).
    loaded = {v: AutoConfig.from_pretrained(d) for v, d in folders.items()}
    rope = {v: getattr(c, "rope_parameters", None) or c.rope_scaling or {} for v, c in loaded.items()}
    assert rope["llama"]["rope_type"] == "llama3" and rope["llama"]["factor"] == 4.0
    assert rope["qwen2"].get("rope_type", "default") == "default"
    assert loaded["llama"].num_key_value_heads == 2 and loaded["qwen2"].num_key_value_heads == 4
    assert loaded["llama"].tie_word_embeddings is False and loaded["qwen2"].tie_word_embeddings is True

    gen = _read(folders["llama"], "generation_config.json")
    assert gen == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 4, "do_sample": False}


@pytest.mark.parametrize("variant", DEMO_VARIANTS)
def test_tokenizer(folders: dict[str, Path], variant: str) -> None:
    tok = AutoTokenizer.from_pretrained(folders[variant])
    raw = Tokenizer.from_file(str(folders[variant] / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == 4096
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token) == (0, 1, 4, None)
    # No BOS/EOS or anything else is added implicitly.
    assert tok("hi")["input_ids"] == tok.encode("hi", add_special_tokens=False) == raw.encode("hi").ids
    assert all(i > 4 for i in tok("hi")["input_ids"])
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        # transformers 5 rebuilds the qwen2 pipeline itself; it must still match tokenizer.json exactly.
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
        assert max(ids) < 4096
    assert tok("<|im_start|>user")["input_ids"][0] == 2
    assert tok.decode([2, *tok.encode("x")[:1], 3], skip_special_tokens=True) == "x"


def test_raw_tokenizer_round_trips_any_text(folders: dict[str, Path]) -> None:
    raw = Tokenizer.from_file(str(folders["llama"] / "tokenizer.json"))
    decomposed = unicodedata.normalize("NFD", "café naïve Ångström")
    for text in (*TEXTS, decomposed, "\x00\x7f\ufeff\U0010ffff", "a" * 300):
        assert raw.decode(raw.encode(text).ids) == text


@pytest.mark.parametrize("variant", DEMO_VARIANTS)
def test_chat_template(folders: dict[str, Path], variant: str) -> None:
    tok = AutoTokenizer.from_pretrained(folders[variant])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "two."}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nPart one, two.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = tok(prompt)["input_ids"]
    assert ids[0] == 2 and ids.count(3) == 4 and ids[-1] != 3


def test_builds_are_byte_identical(tmp_path: Path, folders: dict[str, Path]) -> None:
    again = write_demo_model(tmp_path / "again", "llama")
    for name in FILES:
        assert (again / name).read_bytes() == (folders["llama"] / name).read_bytes(), name

    # A fresh process retrains the tokenizer from scratch; it must come out the same.
    script = "import sys; from worker.models.demo_model import write_demo_model; write_demo_model(sys.argv[1], 'qwen2')"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "other")], cwd=REPO_ROOT, env=env, check=True)
    for name in FILES:
        assert (tmp_path / "other" / name).read_bytes() == (folders["qwen2"] / name).read_bytes(), name

    reseeded = write_demo_model(tmp_path / "seed1", "llama", seed=1)
    assert (reseeded / "tokenizer.json").read_bytes() == (folders["llama"] / "tokenizer.json").read_bytes()
    assert (reseeded / "model.safetensors").read_bytes() != (folders["llama"] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("variant", DEMO_VARIANTS)
def test_greedy_logits_are_peaky(folders: dict[str, Path], models: dict[str, torch.nn.Module], variant: str) -> None:
    tok = AutoTokenizer.from_pretrained(folders[variant])
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about caching."}], tokenize=False, add_generation_prompt=True
    )
    input_ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = models[variant].generate(
            input_ids,
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = torch.cat(out.scores).topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    assert statistics.median(gaps) > 0.5, gaps
    # Not stuck repeating a token: the output depends on the context.
    assert len(set(out.sequences[0, input_ids.shape[1] :].tolist())) > 32


def test_resolve_model_builds_once_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path))
    path = resolve_model("demo")
    assert path == tmp_path / "demo-llama-v2" and (path / "config.json").is_file()
    assert resolve_model("demo:llama") == path
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("rebuilt a cached demo model")

    monkeypatch.setattr(demo_model, "write_demo_model", fail)
    assert resolve_model("demo") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-llama-v2"]


def test_resolve_model_tolerates_losing_the_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path))
    target = tmp_path / "demo-qwen2-v2"

    def racing_write(out_dir: Path, variant: str = "llama", seed: int = 0) -> Path:
        write_demo_model(target, variant, seed)  # another process finishes first...
        return write_demo_model(out_dir, variant, seed)  # ...while we are still building

    monkeypatch.setattr(demo_model, "write_demo_model", racing_write)
    assert resolve_model("demo:qwen2") == target
    assert _read(target, "config.json")["model_type"] == "qwen2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-qwen2-v2"]


def test_resolve_model_paths_and_bad_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(folder))
    (folder / "config.json").write_text("{}", encoding="utf-8")
    assert resolve_model(str(folder)) == folder
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        resolve_model(str(folder / "config.json"))
    for bad in ("", "demo:", "demo:gpt2"):
        with pytest.raises(ValueError):
            resolve_model(bad)
    with pytest.raises(ValueError, match="llama, qwen2"):
        write_demo_model(tmp_path / "x", "gpt2")
    assert not (tmp_path / "cache").exists()
