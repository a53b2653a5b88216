"""``kvgrid plan``: a capacity plan for a model on a GPU type. The arithmetic is common/sizing.py's; this module
reads the model (a folder's config.json and weight files, a GGUF file, a named or Hub-cached model, offline), a
trace's working set, runs the replay at the planned size, and prints."""

from __future__ import annotations

import argparse
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.sizing import (
    DEFAULT_RESERVE_GIB,
    DEFAULT_UTILIZATION,
    DTYPE_BYTES,
    GIB,
    GPUS,
    ModelShape,
    PlanError,
    attention_note,
    auto_dtype,
    gpu_memory,
    groups_for,
    plan,
    shape_from_config,
)

DEFAULT_TRACE_LIMIT = 2000
MAX_REPLAY_GROUPS = 256  # a replay simulates every group: beyond this it is slow, and the plan says enough


@dataclass(frozen=True)
class ModelFacts:
    """A model's shape and where its parameter count comes from: the weight files when there are some (exact),
    else config.json's arithmetic."""

    shape: ModelShape
    params: int
    params_source: str
    file_bytes: int | None = None  # the weights as stored (safetensors or GGUF tensors), for reference


def _safetensors_counts(folder: Path) -> tuple[int, int] | None:
    """(parameters, bytes) of the folder's ``*.safetensors`` files, from their headers alone; None without any."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    params = size = 0
    for f in files:
        with open(f, "rb") as fh:
            try:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            except (struct.error, ValueError) as exc:
                raise PlanError(f"{f} is not a readable safetensors file ({exc}); check the model folder") from None
        for name, t in header.items():
            if name != "__metadata__":
                params += math.prod(t["shape"])
                size += t["data_offsets"][1] - t["data_offsets"][0]
    return params, size


def _from_config(config: Path, name: str) -> ModelFacts:
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {config}: {exc}; give a model folder holding a valid config.json") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{config} is not a JSON object; give a Hugging Face config.json")
    shape = shape_from_config(raw, name)
    counted = _safetensors_counts(config.parent) if config.name == "config.json" else None
    if counted is not None:
        return ModelFacts(shape, counted[0], "safetensors headers", counted[1])
    if shape.params is None:
        raise PlanError(
            f"{name} lacks {', '.join(shape.params_missing)}, needed for the parameter count (and there are no "
            "*.safetensors beside it); give a complete config.json"
        )
    return ModelFacts(shape, shape.params, "config.json")


def _from_gguf(path: Path) -> ModelFacts:
    """Shape from the GGUF metadata (llama.cpp's ``{arch}.*`` keys), parameters from its tensors."""
    from worker.models.gguf import gguf_field, open_gguf

    reader = open_gguf(path)
    arch = str(gguf_field(reader, "general.architecture"))

    def num(key: str, default: Any = ...) -> int | None:
        v = gguf_field(reader, f"{arch}.{key}", default)
        return max(v) if isinstance(v, list) else (None if v is None else int(v))  # per-layer lists: the widest

    heads = num("attention.head_count") or 0
    lora = num("attention.kv_lora_rank", None)
    hidden = num("embedding_length")
    shape = ModelShape(
        name=path.name,
        architecture=f"GGUF {arch}",
        layers=num("block_count") or 0,
        heads=heads,
        kv_heads=num("attention.head_count_kv", heads) or heads,
        head_dim=num("attention.key_length", None) or (hidden or 0) // max(heads, 1),
        kv_lora_rank=lora,
        qk_rope_head_dim=num("rope.dimension_count") if lora else None,
    )
    params = sum(int(t.n_elements) for t in reader.tensors)
    return ModelFacts(shape, params, "GGUF tensors", sum(int(t.n_bytes) for t in reader.tensors))


def _hub_config(repo_id: str) -> Path | None:
    """config.json of a Hub model in huggingface_hub's local cache (never downloaded here); None when absent."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid id
        return None
    return Path(found) if isinstance(found, str) else None


def load_model_facts(model: str) -> ModelFacts:
    """Read ``model``: a config.json file, a model folder, a GGUF file, ``demo[:variant]``, a packaged name
    (``smollm2``: its downloaded GGUF) or an ``org/name`` Hub id in the local Hub cache. Offline."""
    from worker.models.gguf import is_gguf
    from worker.models.registry import PACKAGED, resolve_model

    path = Path(model).expanduser()
    if path.is_file():
        return _from_gguf(path) if is_gguf(path) else _from_config(path, model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"{model} has no config.json; give a Hugging Face model folder, a GGUF file or a name")
        return _from_config(path / "config.json", model)
    if model == "demo" or model.startswith("demo:"):
        return _from_config(resolve_model(model, progress=False) / "config.json", model)  # built locally, cheaply
    if model in PACKAGED:
        from worker.models.cache import cache_root

        gguf = cache_root() / "downloads" / PACKAGED[model].filename
        if not gguf.is_file():
            raise PlanError(f"{model} is not downloaded yet; run kvgrid model-path {model} once, then plan")
        return _from_gguf(gguf)
    parts = model.split("/")
    if len(parts) == 2 and all(parts):
        config = _hub_config(model)
        if config is None:
            raise PlanError(
                f"Hub model {model!r} is not in the local Hugging Face cache (kvgrid plan reads it offline); "
                f"fetch its config first: huggingface-cli download {model} config.json"
            )
        return _from_config(config, model)
    raise PlanError(
        f"model {model!r} is not a file or folder, a named model (demo, {', '.join(PACKAGED)}) nor a Hub id; "
        "check the path or the name"
    )


def trace_figures(path: str, limit: int, block_size: int) -> tuple[list, dict[str, Any]]:
    """The trace's requests (``load_trace``: block keys chained as the router chains them) and its working set:
    distinct blocks, how often each is referenced, and the tokens they hold."""
    from router.sim.replay import load_trace

    trace = load_trace(path, limit=limit)
    tokens: dict[bytes, int] = {}  # distinct block -> its tokens (a prompt's last block may be partial)
    refs = 0
    for r in trace:
        refs += len(r.keys)
        for i, k in enumerate(r.keys):
            tokens[k] = max(tokens.get(k, 0), min(block_size, r.input_length - i * block_size))
    figures = {
        "trace": path,
        "requests": len(trace),
        "block_refs": refs,
        "distinct_blocks": len(tokens),
        "reuse": refs / len(tokens) if tokens else 0.0,  # references per distinct block
        "working_set_tokens": sum(tokens.values()),
    }
    return trace, figures


def _cmd_plan(args: argparse.Namespace) -> int:
    facts = load_model_facts(args.model)
    label, memory = gpu_memory(args.gpu, args.gpu_memory)
    shape = facts.shape
    kv_dtype = auto_dtype(shape, weights=False) if args.dtype == "auto" else args.dtype
    weights_dtype = auto_dtype(shape, weights=True) if args.weights_dtype == "auto" else args.weights_dtype
    out = plan(
        shape,
        facts.params,
        label,
        memory,
        tp=args.tp,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        utilization=args.gpu_memory_utilization,
        reserve_gib=args.reserve_gib,
        block_size=args.block_size,
        working_set_tokens=args.working_set_tokens,
    )
    out["params_source"] = facts.params_source
    out["weights_file_bytes"] = facts.file_bytes
    if args.gpu_memory is None:
        out["gpu_memory_source"] = GPUS[label].source
    if args.trace:
        out.update(_trace_plan(args, out))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(out, shape))
    return 0


def _trace_plan(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """The trace's working set, the groups it needs, and the hit ratio of a replay at that size."""
    from router.sim.replay import replay
    from router.sim.trace import MOONCAKE_BLOCK

    if args.limit < 1:
        raise PlanError(f"--limit {args.limit} replays nothing; give --limit 1 or more")
    trace, figures = trace_figures(args.trace, args.limit, MOONCAKE_BLOCK)
    sized = groups_for(figures["working_set_tokens"], out["kv_tokens_per_group"], out["tp"])
    groups = args.groups or sized["groups_needed"]
    capacity = out["kv_tokens_per_group"]
    if groups > MAX_REPLAY_GROUPS:
        raise PlanError(
            f"the trace needs {groups} groups, more than the {MAX_REPLAY_GROUPS} a replay simulates; replay fewer "
            "requests (--limit) or give --groups"
        )
    if capacity < MOONCAKE_BLOCK:
        raise PlanError(
            f"a group holds {capacity} KV tokens, less than one {MOONCAKE_BLOCK}-token trace block; "
            "give a GPU with more memory or a larger --tp"
        )
    r = replay(trace, groups, capacity, MOONCAKE_BLOCK, progress=False)
    result = {k: r[k] for k in ("groups", "hit_ratio", "pooled_lru_hit_ratio", "infinite_hit_ratio", "imbalance")}
    return {**sized, "trace": figures, "replay": result}


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):,.1f} MiB"


def format_plan(p: dict[str, Any], shape: ModelShape) -> str:
    tp, bs = p["tp"], p["block_size"]
    usable = int(p["gpu_memory_utilization"] * p["gpu_memory_gib"] * GIB)
    lines = [
        f"model       {p['model']} ({p['architecture']}): {p['layers']} layers, {p['heads']} heads, "
        f"{p['kv_heads']} KV heads",
        f"attention   {attention_note(shape)}",
        f"KV/token    {p['kv_formula']}",
    ]
    if tp > 1:
        split = "every GPU keeps the whole latent" if p["attention"] == "MLA" else f"split over {tp} GPUs"
        lines.append(f"            per GPU at --tp {tp} ({split}): {p['kv_bytes_per_token_per_gpu']:,} bytes/token")
    stored = f", stored {_gib(p['weights_file_bytes'])}" if p.get("weights_file_bytes") else ""
    lines += [
        f"weights     {p['params']:,} parameters ({p['params_source']}{stored}) x {DTYPE_BYTES[p['weights_dtype']]} "
        f"bytes ({p['weights_dtype']}) = {_gib(p['weights_bytes'])}; per GPU at --tp {tp}: "
        f"{_gib(p['weights_bytes_per_gpu'])}",
        f"GPU         {p['gpu']}: {p['gpu_memory_gib']:g} GiB x {p['gpu_memory_utilization']:g} = {_gib(usable)}, "
        f"less weights {_gib(p['weights_bytes_per_gpu'])} and reserve {_gib(p['reserve_bytes_per_gpu'])} "
        f"= {_gib(p['kv_budget_bytes_per_gpu'])} of KV per GPU",
        f"group       {tp} GPU{'s' if tp > 1 else ''}: {p['blocks_per_group']:,} blocks of {bs} tokens = "
        f"{p['kv_tokens_per_group']:,} KV tokens",
    ]
    if "trace" in p:
        t = p["trace"]
        lines.append(
            f"trace       {t['requests']:,} requests, {t['block_refs']:,} block references to {t['distinct_blocks']:,} "
            f"distinct blocks (each used {t['reuse']:.2f} times): {t['working_set_tokens']:,} tokens"
        )
    if "groups_needed" in p:
        lines.append(
            f"working set {p['working_set_tokens']:,} tokens: {p['groups_needed']:,} group"
            f"{'s' if p['groups_needed'] > 1 else ''} ({p['gpus_needed']:,} GPUs)"
        )
    if "replay" in p:
        r = p["replay"]
        lines.append(
            f"replay      {r['groups']} group{'s' if r['groups'] > 1 else ''} of {p['kv_tokens_per_group']:,} "
            f"tokens: hit ratio {r['hit_ratio']:.3f} "
            f"(pooled LRU {r['pooled_lru_hit_ratio']:.3f}, infinite cache {r['infinite_hit_ratio']:.3f})"
        )
    return "\n".join(lines)


def add_plan(sub) -> None:
    dtypes = ["auto", *DTYPE_BYTES]
    p = sub.add_parser(
        "plan",
        help="capacity plan: KV bytes per token, weights, KV tokens and blocks per group, groups for a working set",
        description="Sizes worker groups of --tp GPUs for a model: reads MODEL offline (a folder's config.json, a "
        "config.json file, a GGUF file, demo, smollm2 once downloaded, or a Hub id in the local cache).",
    )
    p.add_argument("model", metavar="MODEL", help="model folder, config.json, .gguf file, demo, smollm2 or org/name")
    p.add_argument("--gpu", help=f"GPU type: {', '.join(GPUS)}")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU memory in GiB (instead of --gpu)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per group (default 1)")
    p.add_argument("--dtype", default="auto", choices=dtypes, help="KV cache dtype (auto: the checkpoint's)")
    p.add_argument(
        "--weights-dtype",
        default="auto",
        choices=dtypes,
        help="weights dtype (auto: the checkpoint's, fp8 if so quantized)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION, help="part of GPU memory used")
    p.add_argument(
        "--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB, help="per GPU, for activations and workspaces"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--working-set-tokens", type=int, metavar="N", help="KV tokens to hold: how many groups they need")
    p.add_argument("--trace", metavar="FILE", help="a Mooncake-format trace: its working set and a replay's hit ratio")
    p.add_argument("--limit", type=int, default=DEFAULT_TRACE_LIMIT, help="the trace's first N requests only")
    p.add_argument("--groups", type=int, help="replay with this many groups (default: as many as the trace needs)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=_cmd_plan)
