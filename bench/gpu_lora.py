"""The LoRA benchmark on a GPU, for a session lent one for a few minutes.

    python bench/gpu_lora.py [--out DIR]     # on a CUDA machine: about 3 minutes
    python bench/gpu_lora.py --smoke         # on CPU: a tiny shaped model through the same steps

``worker.bench.run_lora`` (``kvgrid bench lora``: decode tokens/s of a batch of 32 over 8 adapters of rank 16 on all
seven projections vs. the same batch without adapters) on the demo model and on random bfloat16 weights of
Llama-3-8B's layers (bench/gpu_checks.py's shape), each with CUDA graphs (both batches replay graphs: the plain one
its plain graph, the one with adapters the graph through the masked LoRA path, every token times all 8 slots of
rank ``max_lora_rank``, 64 by default) and with both batches eager (the grouped LoRA matmuls, each slot its own rows).
Every result is written to ``--out`` (default ``$OUT``, else ``gpu-lora/``) as it comes, then one markdown table is
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_checks import LLAMA3_8B, SHAPED_NUM_BLOCKS, SMOKE_SHAPE, build_cmd  # noqa: E402


def lora_cmd(**kwargs) -> list[str]:
    code = "import json, sys; from worker.bench import run_lora; run_lora(as_json=True, **json.loads(sys.argv[1]))"
    return [sys.executable, "-c", code, json.dumps(kwargs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny shaped model, to check the script")
    args = p.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or "gpu-lora")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE_SHAPE if args.smoke else LLAMA3_8B
    steps = {"decode_steps": 8, "repeats": 1} if args.smoke else {"decode_steps": 32, "repeats": 3}
    rows: list[dict] = []

    def bench(label: str, **kwargs) -> None:
        r = subprocess.run(lora_cmd(device=device, **steps, **kwargs), env=env, capture_output=True, text=True)
        (out / f"lora_{len(rows)}.txt").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            print(f"{label}: failed\n{r.stderr[-3000:]}", flush=True)
            return
        res = json.loads(r.stdout[r.stdout.index("{") :])
        rows.append({"model": label, **res})
        (out / "lora.json").write_text(json.dumps(rows, indent=2))
        print(f"{label}: {json.dumps(res)}", flush=True)

    bench("demo", model="demo")
    bench("demo", model="demo", cuda_graphs=False)
    folder = Path(tempfile.mkdtemp(prefix="kvgrid-lora-shaped-"))
    try:
        subprocess.run(build_cmd(folder, device, shape), env=env, check=True)
        blocks = 256 if args.smoke else SHAPED_NUM_BLOCKS
        bench("Llama-3-8B layers", model=str(folder), num_blocks=blocks)
        bench("Llama-3-8B layers", model=str(folder), num_blocks=blocks, cuda_graphs=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = [
        "| model | graphs | batch / adapters / rank | without (tok/s) | with (tok/s) | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['dtype']}) | {'yes' if r['cuda_graphs'] else 'no'} | {r['batch']} / {r['adapters']} / "
            f"{r['rank']} | {r['base_tokens_per_s']:.0f} | {r['lora_tokens_per_s']:.0f} | {r['ratio']:.2f} |"
        )
    table = "\n".join(lines)
    (out / "lora.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
