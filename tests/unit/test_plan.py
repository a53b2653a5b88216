"""``kvgrid plan`` (router/cli/plan.py, common/sizing.py): KV bytes per token, parameters, blocks per group and
groups for a working set, checked against figures computed by hand from published architectures; every bad input
is one line and exit code 2; a GGUF file, the demo model and a small trace."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from router.cli import main
from tests.integration.test_gguf import FFN, HIDDEN, KV_HEADS, LAYERS, _vocab, write_llama_gguf

# Published config.json figures. GPT-3 175B (Brown et al. 2020, table 2.1) in GPT-2's key names: 96 layers,
# d_model 12288, 96 heads of 128, context 2048, GPT-2's vocabulary.
GPT3_175B = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_layer": 96,
    "n_head": 96,
    "n_embd": 12288,
    "n_positions": 2048,
    "vocab_size": 50257,
}
LLAMA2_70B = {  # meta-llama/Llama-2-70b-hf
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
LLAMA3_70B = {**LLAMA2_70B, "vocab_size": 128256, "torch_dtype": "bfloat16"}  # meta-llama/Meta-Llama-3-70B
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def _config(tmp_path: Path, raw: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one error line of a plan that must fail with exit code 2."""
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("kvgrid: error: ") and "; " in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("raw", "dtype", "attention", "per_token"),
    [
        (GPT3_175B, "float16", "MHA", 96 * 96 * 128 * 2 * 2),  # = 4,718,592: layers x KV heads x dim x K,V x 2 B
        (LLAMA2_70B, "bfloat16", "GQA", 80 * 8 * 128 * 2 * 2),  # = 327,680
        (LLAMA3_70B, "bfloat16", "GQA", 80 * 8 * 128 * 2 * 2),  # = 327,680: the same KV shape as Llama 2 70B
        (DEEPSEEK_V3, "bfloat16", "MLA", (512 + 64) * 61 * 2),  # = 70,272: one latent + rotary key, no x2
    ],
)
def test_kv_bytes_per_token_of_published_models(tmp_path, capsys, raw, dtype, attention, per_token) -> None:
    assert per_token in (4_718_592, 327_680, 70_272)
    p = plan_json(capsys, _config(tmp_path, raw), "--gpu-memory", "100000", "--dtype", dtype)
    assert p["kv_bytes_per_token"] == per_token
    assert p["attention"] == attention
    assert f"= {per_token:,} bytes/token" in p["kv_formula"]


def test_parameter_counts_of_published_models(tmp_path, capsys) -> None:
    # Llama 2 70B by hand: per layer Q, O 2 x 8192^2 = 134,217,728; K, V 2 x 8192 x 1024 = 16,777,216; MLP
    # 3 x 8192 x 28672 = 704,643,072; norms 2 x 8192 = 16,384: 855,654,400 x 80 = 68,452,352,000; embeddings and
    # LM head 2 x 32000 x 8192 = 524,288,000; final norm 8,192: 68,976,648,192 (the checkpoint's exact count).
    p = plan_json(capsys, _config(tmp_path, LLAMA2_70B), "--gpu-memory", "100000")
    assert p["params"] == 68_976_648_192 and p["params_source"] == "config.json"
    assert p["weights_dtype"] == "float16" and p["weights_bytes"] == 2 * 68_976_648_192
    # Published totals, within 1%: GPT-3 175B, Llama 3 70B 70.6B, DeepSeek-V3 671B (without its MTP module).
    for raw, published in ((GPT3_175B, 175e9), (LLAMA3_70B, 70.6e9), (DEEPSEEK_V3, 671e9)):
        p = plan_json(capsys, _config(tmp_path, raw), "--gpu-memory", "100000")
        assert p["params"] == pytest.approx(published, rel=0.01)
    assert p["weights_dtype"] == "fp8" and p["weights_bytes"] == p["params"]  # DeepSeek-V3's checkpoint is fp8
    assert p["kv_dtype"] == "bfloat16"


def test_blocks_per_group_and_groups_for_a_working_set(tmp_path, capsys) -> None:
    # Llama 2 70B, bf16 weights and KV, 8 x H100 (80 GiB), utilization 0.9, the default 2 GiB reserve:
    # weights 68,976,648,192 x 2 B / 8 GPUs = 17,244,162,048 B per GPU; usable 0.9 x 80 GiB = 77,309,411,328 B;
    # KV budget 77,309,411,328 - 17,244,162,048 - 2,147,483,648 = 57,917,765,632 B per GPU;
    # a GPU's share of a token 327,680 / 8 = 40,960 B, of a 16-token block 655,360 B;
    # 57,917,765,632 // 655,360 = 88,375 blocks = 1,414,000 tokens per group.
    # 10,000,000 working-set tokens / 1,414,000 = 7.07: 8 groups, 64 GPUs.
    config = _config(tmp_path, LLAMA2_70B)
    args = [config, "--gpu", "h100", "--tp", "8", "--dtype", "bfloat16", "--weights-dtype", "bfloat16"]
    p = plan_json(capsys, *args, "--gpu-memory-utilization", "0.9", "--working-set-tokens", "10000000")
    assert p["weights_bytes_per_gpu"] == 17_244_162_048
    assert p["kv_budget_bytes_per_gpu"] == 57_917_765_632
    assert p["kv_bytes_per_token_per_gpu"] == 40_960
    assert p["blocks_per_group"] == 88_375 and p["kv_tokens_per_group"] == 1_414_000
    assert (p["groups_needed"], p["gpus_needed"]) == (8, 64)
    assert p["gpu_memory_source"].startswith("NVIDIA H100")

    assert main(["plan", *args, "--working-set-tokens", "10000000"]) == 0
    text = capsys.readouterr().out
    assert "80 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes (bfloat16) = 327,680 bytes/token" in text
    assert "GQA (8 KV heads < 64 heads)" in text
    assert "88,375 blocks of 16 tokens = 1,414,000 KV tokens" in text
    assert "10,000,000 tokens: 8 groups (64 GPUs)" in text


def test_mla_keeps_the_whole_latent_on_every_gpu(tmp_path, capsys) -> None:
    p = plan_json(capsys, _config(tmp_path, DEEPSEEK_V3), "--gpu", "h200", "--tp", "8")
    assert p["kv_bytes_per_token_per_gpu"] == p["kv_bytes_per_token"] == 70_272
    assert p["blocks_per_group"] == p["kv_budget_bytes_per_gpu"] // (70_272 * 16)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    llama = _config(tmp_path, LLAMA2_70B)
    incomplete = _config(tmp_path, {"num_attention_heads": 8, "vocab_size": 100}, "incomplete.json")
    line = plan_error(capsys, incomplete, "--gpu", "h100")
    assert "lacks num_hidden_layers, head_dim (or hidden_size)" in line
    no_mlp = _config(tmp_path, {k: v for k, v in LLAMA2_70B.items() if k != "intermediate_size"}, "no_mlp.json")
    assert "lacks intermediate_size, needed for the parameter count" in plan_error(capsys, no_mlp, "--gpu", "h100")
    line = plan_error(capsys, llama, "--gpu", "h100", "--tp", "16")
    assert "--tp 16 does not divide the 8 KV heads; use one of 1, 2, 4, 8" in line
    line = plan_error(capsys, llama, "--gpu", "h100", "--tp", "1")  # 128.5 GiB of fp16 weights on one H100
    assert "the weights need 128.5 GiB per GPU" in line and "a GPU has 72.0 GiB (80 GiB x 0.9)" in line
    line = plan_error(capsys, llama, "--gpu", "x100")
    assert "unknown GPU 'x100'; use one of b200, h200, h100," in line and "--gpu-memory" in line
    assert "no GPU given" in plan_error(capsys, llama)
    assert "not a file or folder" in plan_error(capsys, str(tmp_path / "missing"), "--gpu", "h100")


def test_the_demo_model_folder(demo_path, capsys) -> None:
    # The demo model: 4 layers, 2 KV heads of 64 -> 4 x 2 x 64 x 2 x 2 B = 2,048 B/token in bf16. Parameters:
    # embeddings and head 2 x 4096 x 256 = 2,097,152; per layer Q, O 2 x 256 x 256 + K, V 2 x 256 x 128 = 196,608,
    # MLP 3 x 256 x 768 = 589,824, norms 512: 786,944 x 4 = 3,147,776; final norm 256: 5,245,184.
    p = plan_json(capsys, str(demo_path), "--gpu", "l4")
    assert p["kv_bytes_per_token"] == 2_048 and p["kv_dtype"] == "bfloat16"  # the config's float32: bf16 on a GPU
    assert p["params"] == 5_245_184 and p["params_source"] == "safetensors headers"
    assert p["weights_file_bytes"] == 4 * 5_245_184  # stored in float32
    assert plan_json(capsys, "demo", "--gpu", "l4")["params"] == 5_245_184


def test_a_gguf_file(tmp_path, capsys) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", T.Q8_0)
    vocab, head_dim = len(_vocab()[0]), HIDDEN // 4
    per_layer = 2 * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * KV_HEADS * head_dim * HIDDEN + 3 * FFN * HIDDEN
    p = plan_json(capsys, str(path), "--gpu", "l4", "--dtype", "float32")
    assert p["params"] == 2 * vocab * HIDDEN + HIDDEN + LAYERS * per_layer
    assert p["params_source"] == "GGUF tensors" and p["weights_file_bytes"] < 4 * p["params"]  # Q8_0 stored
    assert p["kv_bytes_per_token"] == LAYERS * KV_HEADS * head_dim * 2 * 4
    assert p["attention"] == "GQA"


def test_a_trace_sizes_the_groups_and_replays(tmp_path, capsys) -> None:
    # Four requests, blocks of 512 tokens: A [0,1,2] 1500 tokens, B [0,1,3] 1536, A again, D [4] 100. Chained
    # keys: k0, k01, k012, k013, k4 are the 5 distinct blocks of 10 references; their tokens 512 + 512 + 476
    # (A's last block is partial) + 512 + 100 = 2,112.
    rows = [([0, 1, 2], 1500), ([0, 1, 3], 1536), ([0, 1, 2], 1500), ([4], 100)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 1000, "input_length": n, "output_length": 4, "hash_ids": ids}) + "\n"
            for i, (ids, n) in enumerate(rows)
        )
    )
    # A model of one layer, one KV head of 64: 1 x 1 x 64 x 2 x 2 B = 256 B/token. Parameters: embeddings and head
    # 2 x 64 x 64 = 8,192, final norm 64, Q, K, V, O 4 x 64 x 64 = 16,384, MLP 3 x 64 x 64 = 12,288, norms 128:
    # 37,056, 74,112 B in bf16. A GPU of exactly 74,112 + 1,024 x 256 B, no reserve: 1,024 tokens a group, so
    # 2,112 tokens need 3 groups.
    tiny = {"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 64, "intermediate_size": 64}
    config = _config(tmp_path, {**tiny, "vocab_size": 64, "torch_dtype": "bfloat16"})
    memory = repr((74_112 + 1_024 * 256) / 2**30)
    args = [config, "--gpu-memory", memory, "--gpu-memory-utilization", "1", "--reserve-gib", "0"]
    p = plan_json(capsys, *args, "--trace", str(trace))
    assert p["params"] == 37_056 and p["kv_tokens_per_group"] == 1_024
    t = p["trace"]
    assert (t["requests"], t["block_refs"], t["distinct_blocks"], t["working_set_tokens"]) == (4, 10, 5, 2_112)
    assert p["groups_needed"] == 3 and p["replay"]["groups"] == 3
    # The infinite cache keeps full blocks: B hits k0, k01 (1,024 tokens), A's repeat k0, k01 (1,024).
    r = p["replay"]
    assert r["infinite_hit_ratio"] == pytest.approx(2_048 / (1500 + 1536 + 1500 + 100))
    assert 0 <= r["hit_ratio"] <= r["infinite_hit_ratio"] + 1e-9
    assert main(["plan", *args, "--trace", str(trace), "--limit", "2", "--groups", "1"]) == 0
    text = capsys.readouterr().out
    assert "2 requests, 6 block references to 4 distinct blocks" in text and "replay      1 group of" in text
    assert math.isfinite(r["imbalance"])


def test_named_models_are_read_offline(demo_path, tmp_path, capsys, monkeypatch) -> None:
    """A Hub id is read from huggingface_hub's local cache (laid out as it lays it out), never downloaded; smollm2
    only once its GGUF file is downloaded."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text((demo_path / "config.json").read_text())
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-m", "router.cli", "plan", "--gpu", "l4", "--json"]
    found = subprocess.run([*run, "acme/tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["params"] == 5_245_184  # from config.json: no weights in the cache
    missing = subprocess.run([*run, "acme/none"], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "not in the local Hugging Face cache" in missing.stderr
    # A cache without smollm2's download (the session's may hold it: the real-model tests fetch it).
    monkeypatch.setenv("KVGRID_CACHE", str(tmp_path / "empty-cache"))
    assert "run kvgrid model-path smollm2 once" in plan_error(capsys, "smollm2", "--gpu", "l4")
