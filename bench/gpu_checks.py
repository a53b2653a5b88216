"""The serving-speed issue's GPU checks in one run, for a session that is lent a GPU for a few minutes.

    python bench/gpu_checks.py [--out DIR]    # on a CUDA machine: about 3-6 minutes
    python bench/gpu_checks.py --smoke        # on CPU: tiny shapes through the same steps, to check the script

1. ``bench/attention.py``: the Triton paged-attention kernels against torch's SDPA (issue 3's targets), as it
   prints them;
2. ``kvgrid bench engine --device cuda`` (``worker.bench.run``) with decode in CUDA graphs and with
   ``--no-cuda-graphs`` (eager), on the demo model, batches 1/8/32/128: TTFT cold and over a cached prefix,
   decode tokens/s per batch, the closed loop per stream count;
3. one markdown table of (2), graphs against eager, and the machine (GPU, torch, Triton), printed and written with
   every raw output into ``--out`` (default ``$OUT`` where set, else ``gpu-checks/``).

It needs only what kvgrid's engine imports (torch, Triton, safetensors, tokenizers, xxhash, and PyYAML through
huggingface_hub): no Ray, Redis, pydantic or HTTP server, so it runs on a GPU machine's stock PyTorch image as it
is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], env: dict[str, str], log: Path) -> str:
    """``cmd`` from the repository's root; its output, also written to ``log``. A failure stops the checks with
    the command's output tail."""
    print("+", " ".join(cmd[:2] + ["..."] + cmd[3:] if cmd[1] == "-c" else cmd), flush=True)
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(out.stdout + ("\n--- stderr ---\n" + out.stderr if out.stderr else ""))
    if out.returncode != 0:
        raise SystemExit(f"{log.name}: the command failed ({out.returncode}):\n{out.stderr[-3000:]}")
    print(f"  done in {time.monotonic() - start:.0f} s", flush=True)
    return out.stdout


def engine_cmd(**kwargs: Any) -> list[str]:
    """``kvgrid bench engine --json`` as ``worker.bench.run(**kwargs)``: the same benchmark and JSON without the
    CLI, whose parser imports the gateway's pydantic models (not on a stock PyTorch image)."""
    code = "import json, sys; from worker.bench import run; run(as_json=True, **json.loads(sys.argv[1]))"
    return [sys.executable, "-c", code, json.dumps(kwargs)]


def engine_table(graphs: dict[str, Any], eager: dict[str, Any]) -> str:
    """Markdown: each figure with CUDA graphs, eager, and graphs over eager (a speed-up either way: TTFT as
    eager / graphs, tokens/s as graphs / eager)."""
    lines = [
        f"engine on {graphs['device']} ({graphs['dtype']}, prompt {graphs['prompt_tokens']} tokens; "
        f"CUDA graphs captured: {graphs['cuda_graphs']}, eager run: {not eager['cuda_graphs']})",
        "",
        "| figure | CUDA graphs | eager | speed-up |",
        "| --- | --- | --- | --- |",
    ]
    ttfts = [("TTFT cold", "ttft_cold_ms"), (f"TTFT, {graphs['hit_cached_tokens']} tokens cached", "ttft_hit_ms")]
    for label, key in ttfts:
        g, e = graphs[key], eager[key]
        lines.append(f"| {label} (ms) | {g:.2f} | {e:.2f} | {e / g:.2f}x |")
    for b, g in graphs["decode_tokens_per_s"].items():
        e = eager["decode_tokens_per_s"][b]
        lines.append(f"| decode, batch {b} (tokens/s) | {g:.0f} | {e:.0f} | {g / e:.2f}x |")
    loop_g, loop_e = graphs["closed_loop"], eager["closed_loop"]
    shape = f"{loop_g['prompt_tokens']} + {loop_g['output_tokens']} tokens"
    for b, g in loop_g.items():
        if isinstance(g, dict):
            e = loop_e[b]
            lines.append(
                f"| closed loop of {shape}, {b} at a time (tokens/s) | {g['tokens_per_s']:.0f} | "
                f"{e['tokens_per_s']:.0f} | {g['tokens_per_s'] / e['tokens_per_s']:.2f}x |"
            )
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for the outputs (default: $OUT, else gpu-checks/)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Triton's interpreter, to check the script")
    args = p.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu-checks")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

    import torch

    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        device, attention = "cpu", [sys.executable, "bench/attention.py", "--quick", "--dtype", "float16"]
        engine: dict[str, Any] = {"prompt_len": 64, "cached": 48, "batches": [1, 2], "decode_steps": 4, "repeats": 1}
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine (or --smoke on CPU to check the script)", file=sys.stderr)
            return 2
        device, attention = "cuda", [sys.executable, "bench/attention.py"]
        engine = {"batches": [1, 8, 32, 128]}

    host = machine()
    print(f"machine: {host}", flush=True)
    attention_out = run(attention, env, out / "attention.txt")
    graphs = json.loads(run(engine_cmd(device=device, **engine), env, out / "engine_graphs.json"))
    eager = json.loads(run(engine_cmd(device=device, cuda_graphs=False, **engine), env, out / "engine_eager.json"))
    table = engine_table(graphs, eager)
    report = f"machine: {host}\n\n## bench/attention.py\n\n```\n{attention_out.strip()}\n```\n\n## engine\n\n{table}\n"
    (out / "gpu_checks.md").write_text(report)
    print("\n" + report)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
