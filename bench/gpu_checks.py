"""kvgrid's GPU checks in one run, for a session that is lent a GPU for a few minutes.

    python bench/gpu_checks.py [--out DIR]    # on a CUDA machine: about 3-5 minutes
    python bench/gpu_checks.py --smoke        # on CPU: tiny shapes through the same steps, to check the script

1. ``bench/attention.py``: the Triton paged-attention kernels against torch's SDPA, as it
   prints them;
2. ``kvgrid bench engine --device cuda`` (``worker.bench.run``) with decode in CUDA graphs and with
   ``--no-cuda-graphs`` (eager), on the demo model, batches 1/8/32/128: TTFT cold and over a cached prefix,
   decode tokens/s per batch, the closed loop per stream count; its table is written before step 3 starts;
3. ``--shape llama3-8b``: the same benchmark (CUDA graphs only, unless ``--shape-eager``) on random bfloat16 weights
   of Llama-3-8B's layers with the demo tokenizer and vocabulary (``write_shaped_model``), built into a temporary
   folder on the GPU machine: a size where the GPU, not the engine's Python, sets the pace;
4. one markdown report of (1)-(3), the machine (GPU, torch, Triton) and what each phase took, printed and written
   with every raw output into ``--out`` (default ``$OUT`` where set, else ``gpu-checks/``).

It needs only what kvgrid's engine imports (torch, Triton, safetensors, tokenizers, xxhash, and PyYAML through
huggingface_hub): no Ray, Redis, pydantic or HTTP server, so it runs on a GPU machine's stock PyTorch image as it
is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Llama-3-8B's layers; the demo vocabulary (4096 tokens) keeps the embedding and head small.
LLAMA3_8B = {
    "num_layers": 32,
    "hidden": 4096,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate": 14336,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "max_positions": 8192,
}
# --smoke: the same code path at a size a CPU runs in seconds.
SMOKE_SHAPE = {
    **LLAMA3_8B,
    "num_layers": 2,
    "hidden": 128,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 32,
    "intermediate": 448,
}
# KV blocks for the shaped model: 256k tokens (32 GiB at 8B), far more than the benchmark holds at once, and
# leaves most of the GPU free, for CUDA graphs and activations.
SHAPED_NUM_BLOCKS = 16384


def run(cmd: list[str], env: dict[str, str], log: Path, timings: list[str]) -> str:
    """``cmd`` from the repository's root; its output, also written to ``log``. Its time, and the phases it
    reports on stderr (lines starting ``phase:``), are printed and appended to ``timings``. A failure stops the
    checks with the command's output tail."""
    print("+", " ".join(cmd[:2] + ["..."] + cmd[3:] if cmd[1] == "-c" else cmd), flush=True)
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(out.stdout + ("\n--- stderr ---\n" + out.stderr if out.stderr else ""))
    if out.returncode != 0:
        raise SystemExit(f"{log.name}: the command failed ({out.returncode}):\n{out.stderr[-3000:]}")
    phases = [line.removeprefix("phase:").strip() for line in out.stderr.splitlines() if line.startswith("phase:")]
    took = f"{time.monotonic() - start:.0f} s" + (f" ({'; '.join(phases)})" if phases else "")
    print(f"  done in {took}", flush=True)
    timings.append(f"{log.name}: {took}")
    return out.stdout


def engine_cmd(**kwargs: Any) -> list[str]:
    """``kvgrid bench engine --json`` as ``worker.bench.run(**kwargs)``: the same benchmark and JSON without the
    CLI, whose parser imports the gateway's pydantic models (not on a stock PyTorch image). Its phases' times go
    to stderr."""
    code = (
        "import json, sys; from worker.bench import run; t = {}; run(as_json=True, timings=t, "
        "**json.loads(sys.argv[1])); print('phase:', ', '.join(f'{k} {v:.1f} s' for k, v in t.items()), "
        "file=sys.stderr)"
    )
    return [sys.executable, "-c", code, json.dumps(kwargs)]


def build_cmd(folder: Path, device: str, shape: dict[str, Any]) -> list[str]:
    """``write_shaped_model`` into ``folder``, the weights drawn on ``device``."""
    code = (
        "import json, sys; from worker.models.demo_model import write_shaped_model; "
        "write_shaped_model(sys.argv[1], device=sys.argv[2], **json.loads(sys.argv[3]))"
    )
    return [sys.executable, "-c", code, str(folder), device, json.dumps(shape)]


def _figures(r: dict[str, Any], ref: dict[str, Any]) -> Iterator[tuple[str, float, str, bool]]:
    """(label, value, format, higher is better) of each figure of ``r``, labelled and ordered as ``ref``'s."""
    yield "TTFT cold (ms)", r["ttft_cold_ms"], ".2f", False
    yield f"TTFT, {ref['hit_cached_tokens']} tokens cached (ms)", r["ttft_hit_ms"], ".2f", False
    for b in ref["decode_tokens_per_s"]:
        yield f"decode, batch {b} (tokens/s)", r["decode_tokens_per_s"][b], ".0f", True
    loop = ref["closed_loop"]
    shape = f"{loop['prompt_tokens']} + {loop['output_tokens']} tokens"
    for b, v in loop.items():
        if isinstance(v, dict):
            label = f"closed loop of {shape}, {b} at a time (tokens/s)"
            yield label, r["closed_loop"][b]["tokens_per_s"], ".0f", True


def engine_table(graphs: dict[str, Any], eager: dict[str, Any] | None = None) -> str:
    """Markdown: each figure with CUDA graphs and, given an eager run, eager and graphs over eager (a speed-up
    either way: TTFT as eager / graphs, tokens/s as graphs / eager)."""
    run_kinds = f"CUDA graphs captured: {graphs['cuda_graphs']}"
    if eager is not None:
        run_kinds += f", eager run: {not eager['cuda_graphs']}"
    lines = [
        f"engine on {graphs['device']} ({graphs['dtype']}, prompt {graphs['prompt_tokens']} tokens; {run_kinds})",
        "",
        "| figure | CUDA graphs | eager | speed-up |" if eager else "| figure | CUDA graphs |",
        "| --- | --- | --- | --- |" if eager else "| --- | --- |",
    ]
    if eager is None:
        lines += [f"| {label} | {g:{fmt}} |" for label, g, fmt, _ in _figures(graphs, graphs)]
        return "\n".join(lines)
    for (label, g, fmt, higher), (_, e, _, _) in zip(_figures(graphs, graphs), _figures(eager, graphs)):
        lines.append(f"| {label} | {g:{fmt}} | {e:{fmt}} | {(g / e if higher else e / g):.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}; torch {torch.__version__}, Triton {triton_version}, Python {sys.version.split()[0]}"


def shaped_part(
    label: str,
    shape: dict[str, Any],
    device: str,
    engine: dict[str, Any],
    eager: bool,
    env: dict[str, str],
    out: Path,
    timings: list[str],
) -> str:
    """Build the shaped model in a temporary folder, benchmark it, and return its report section (the folder is
    removed after)."""
    import torch

    folder = Path(tempfile.mkdtemp(prefix="kvgrid-shaped-"))
    try:
        run(build_cmd(folder, device, shape), env, out / "build_shaped_model.txt", timings)
        config = json.loads((folder / "config.json").read_text())
        size = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        params = size // torch.empty((), dtype=getattr(torch, config["torch_dtype"])).element_size()
        kwargs = {**engine, "model": str(folder), "device": device, "num_blocks": SHAPED_NUM_BLOCKS}
        graphs = json.loads(run(engine_cmd(**kwargs), env, out / "engine_shaped_graphs.json", timings))
        no_graphs = None
        if eager:
            no_graphs = json.loads(
                run(engine_cmd(cuda_graphs=False, **kwargs), env, out / "engine_shaped_eager.json", timings)
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    facts = (
        f"{label}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} KV) of {config['head_dim']}, "
        f"MLP {config['intermediate_size']}, vocabulary {config['vocab_size']}; weights {size / 1e9:.3g} GB "
        f"({params / 1e9:.3g} B parameters, {config['torch_dtype']}, random)"
    )
    return f"{facts}\n\n{engine_table(graphs, no_graphs)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for the outputs (default: $OUT, else gpu-checks/)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Triton's interpreter, to check the script")
    p.add_argument(
        "--shape",
        choices=["demo", "llama3-8b", "both"],
        default="both",
        help="the engine benchmark's model: the demo model (graphs and eager), Llama-3-8B's layers with the demo "
        "vocabulary (graphs), or both in that order (default)",
    )
    p.add_argument(
        "--shape-eager",
        action="store_true",
        help="benchmark the Llama-3-8B shape eagerly too (about a minute and a half more)",
    )
    args = p.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu-checks")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

    import torch

    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        device, attention = "cpu", [sys.executable, "bench/attention.py", "--quick", "--dtype", "float16"]
        engine: dict[str, Any] = {"prompt_len": 64, "cached": 48, "batches": [1, 2], "decode_steps": 4, "repeats": 1}
        shape, label = SMOKE_SHAPE, "smoke shape (Llama-3-8B's code path at 2 layers, 128 wide), demo vocabulary"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine (or --smoke on CPU to check the script)", file=sys.stderr)
            return 2
        device, attention = "cuda", [sys.executable, "bench/attention.py"]
        engine = {"batches": [1, 8, 32, 128]}
        shape, label = LLAMA3_8B, "Llama-3-8B layers, demo vocabulary"
    out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    timings: list[str] = []
    host = machine()
    print(f"machine: {host}", flush=True)
    attention_out = run(attention, env, out / "attention.txt", timings)
    report = f"machine: {host}\n\n## bench/attention.py\n\n```\n{attention_out.strip()}\n```\n"

    def write() -> None:
        took = f"\n## timings (total {time.monotonic() - started:.0f} s)\n\n" + "".join(f"- {t}\n" for t in timings)
        (out / "gpu_checks.md").write_text(report + took)

    if args.shape in ("demo", "both"):
        graphs = json.loads(run(engine_cmd(device=device, **engine), env, out / "engine_graphs.json", timings))
        eager = json.loads(
            run(engine_cmd(device=device, cuda_graphs=False, **engine), env, out / "engine_eager.json", timings)
        )
        report += f"\n## engine: demo model\n\n{engine_table(graphs, eager)}\n"
        write()  # before the shaped model's part, which may fail or run out of time
        print(f"\n## engine: demo model\n\n{engine_table(graphs, eager)}\n", flush=True)
    status = 0
    if args.shape in ("llama3-8b", "both"):
        try:
            section = shaped_part(label, shape, device, engine, args.shape_eager, env, out, timings)
        except (SystemExit, Exception) as e:  # keep what the earlier parts measured
            section, status = f"failed:\n\n```\n{e}\n```", 1
        report += f"\n## engine: {label}\n\n{section}\n"
    write()
    print("\n" + (out / "gpu_checks.md").read_text())
    print(f"written to {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
