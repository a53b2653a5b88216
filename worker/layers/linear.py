"""Column- and row-parallel linear layers. Each parameter knows how to load its rank's slice of an HF tensor."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common import env
from worker.distributed import all_reduce, shard_range, tp_rank, tp_size

if TYPE_CHECKING:
    from worker.lora import LoraBatch

# oneDNN's fp32 matmul beat the default (MKL) path on the skinny matmuls of a small batch on an AVX512 CPU (demo
# model, 2 cores: decode steps 20-30% faster at batch 1, 8 and 32) and lost on an AVX2-only one, so the engine
# times both on its model at start (pick_float32_path). Same math, rounded differently. The op is private: a build
# may lack it or refuse it at run time, so the first call decides whether it can be used at all.
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_use_onednn: bool | None = None if _onednn_linear is not None else False  # None: not tried yet


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    assert _onednn_linear is not None
    return _onednn_linear(x, weight, bias, "none", [], "")  # no fused activation


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; through oneDNN for 2-D float32 inputs on the CPU, where it works, and from the packed copy of
    a weight that ``pack_linear_weights`` made."""
    global _use_onednn
    packed = getattr(weight, "packed", None)
    if packed is not None and _onednn_linear is not None:  # (packed only where the op exists)
        return _onednn(x, packed, bias)
    if (
        _onednn_linear is not None
        and _use_onednn is not False
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        if _use_onednn:
            return _onednn(x, weight, bias)
        try:
            y = _onednn(x, weight, bias)
        except Exception:  # whatever the private op raises, F.linear computes the same thing
            _use_onednn = False
        else:
            _use_onednn = True
            return y
    return F.linear(x, weight, bias)


FLOAT32_PATHS = ("packed", "onednn", "torch")


_PACK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # a probe matmul's agreement with F.linear


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def force_float32_path(path: str) -> str:
    """Make ``linear`` take ``path`` (``"onednn"``/``"packed"``: oneDNN, ``"torch"``: ``F.linear``); returns it."""
    global _use_onednn
    _use_onednn = path != "torch"
    return path


# The row count oneDNN lays a packed weight out for (any count computes; the layout suits small batches).
PACK_BATCH_HINT = 64


def pick_float32_path(model: nn.Module, rows: tuple[int, ...] = (1, 8, 32), reps: int = 5) -> str | None:
    """CPU float32: time the three ways to multiply by this model's own linear weights at a few batch sizes, in
    turns, and let ``linear`` take the fastest from now on: ``"torch"`` (``F.linear``, MKL), ``"onednn"``
    (oneDNN's matmul, which reorders the weight on every call) or ``"packed"`` (oneDNN from a copy reordered once;
    the caller then packs the weights, ``pack_linear_weights``). Which wins depends on the CPU: plain oneDNN made
    decode steps 20-30% faster on an AVX512 EPYC and 9-27% slower (batch 32 / batch 8) on an AVX2-only one, where
    the packed weights beat ``F.linear`` by 20-50% at 8-32 rows (the same at 1 and at 128+). Ties go to
    ``F.linear``. ``KVGRID_CPU_LINEAR=packed|onednn|torch`` decides without timing (``auto``, the default, times).
    Returns the choice; None when there is nothing to decide (no oneDNN op, or no float32 CPU weight)."""
    choice = env.cpu_linear()
    if _onednn_linear is None or _use_onednn is False:
        return None if _use_onednn is None else "torch"
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if choice != "auto":  # the operator's word (the same path on every rank and group, say)
        return force_float32_path(choice)
    count: dict[tuple[int, ...], int] = {}  # a shape's share of a step: how many layers have it
    weights: dict[tuple[int, ...], torch.Tensor] = {}
    for m in model.modules():
        w = getattr(m, "weight", None) if getattr(m, "packable", False) else None
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu":
            count[tuple(w.shape)] = count.get(tuple(w.shape), 0) + 1
            weights.setdefault(tuple(w.shape), w.detach())
    if not weights:
        return None
    took = dict.fromkeys(FLOAT32_PATHS, 0.0)
    try:
        for shape, w in weights.items():
            packed = reorder(w, PACK_BATCH_HINT) if reorder is not None else None
            ways = {"torch": (_dense, w), "onednn": (_onednn, w)}
            if packed is not None:
                ways["packed"] = (_onednn, packed)
            for n in rows:
                x = torch.randn(n, w.shape[1])
                times: dict[str, list[float]] = {k: [] for k in ways}
                for f, wt in ways.values():  # warm each
                    f(x, wt, None)
                for _ in range(reps):
                    for k, (f, wt) in ways.items():
                        t = time.perf_counter()
                        f(x, wt, None)
                        times[k].append(time.perf_counter() - t)
                for k in FLOAT32_PATHS:
                    took[k] += count[shape] * min(times[k]) if k in times else float("inf")
    except Exception:  # whatever the private ops raise, F.linear computes the same thing
        return force_float32_path("torch")
    return force_float32_path(min(FLOAT32_PATHS[::-1], key=took.__getitem__))  # (reversed: a tie goes to F.linear)


def pack_linear_weights(model: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> int:
    """CPU, bfloat16 or float32 (where ``pick_float32_path`` chose it): reorder every linear weight once into
    oneDNN's blocked layout (``packed`` on the parameter, which ``linear`` then computes from) and drop the dense
    copy, so the weights' memory stays what it was. Each matmul then skips the reorder oneDNN otherwise makes per
    call: the same results bit for bit, faster at the few rows of a decode step, the same at a prefill's. A weight
    another module shares (tied embeddings) stays dense. All or nothing: where the ops are missing, or a probe
    matmul through a packed weight does not match ``F.linear``, nothing is packed. Returns how many were."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    layers = [
        m
        for m in model.modules()
        if getattr(m, "packable", False) and owners[id(m.weight)] == 1 and getattr(m.weight, "packed", None) is None
    ]
    if _onednn_linear is None or reorder is None or not layers:
        return 0
    packed = []
    try:
        for m in layers:
            w, b = m.weight, getattr(m, "bias", None)
            if w.dtype not in _PACK_TOLERANCE or w.device.type != "cpu" or w.dim() != 2:
                return 0
            p = reorder(w.detach(), batch_hint)
            probe = torch.randn(3, w.shape[1], dtype=w.dtype)
            tol = _PACK_TOLERANCE[w.dtype]
            if not torch.allclose(_onednn(probe, p, b).float(), F.linear(probe, w, b).float(), rtol=tol, atol=tol):
                return 0
            packed.append(p)
    except Exception:  # whatever the private ops raise, the dense weights compute the same thing
        return 0
    for m, p in zip(layers, packed):
        weight = m.weight
        assert isinstance(weight, torch.Tensor)
        weight.packed = p  # type: ignore[attr-defined]
        weight.data = torch.empty(0, dtype=weight.dtype)
    return len(layers)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T``, with W's output rows split over ranks; each rank returns its slice of ``y``."""

    packable = True  # its weight is only ever read by ``linear`` (see pack_linear_weights)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.rank, self.world = tp_rank(), tp_size()
        start, end = shard_range(out_features, self.rank, self.world)
        self.weight = nn.Parameter(torch.empty(end - start, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_sharded  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(end - start), requires_grad=False)
            self.bias.weight_loader = self.load_sharded  # type: ignore[attr-defined]

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        start, end = shard_range(loaded.shape[0], self.rank, self.world)
        param.data.copy_(loaded[start:end])

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return y if lora is None else lora.add(self, x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections); shard ``i`` loads part ``i``."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        offset = sum(self.out_sizes[:shard_id]) // self.world
        start, end = shard_range(loaded.shape[0], self.rank, self.world)
        param.data[offset : offset + end - start].copy_(loaded[start:end])


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by heads. With more ranks than KV heads, KV heads are
    replicated so that each rank holds exactly one."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        world = tp_size()
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not split over {world} ranks")
        if num_kv_heads >= world and num_kv_heads % world or num_kv_heads < world and world % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {world} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // world
        self.num_kv_heads = max(1, num_kv_heads // world)
        self.total_kv_heads = num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_size, self.kv_size = q, kv
        # The parent splits out_features by the world size; hand it the full (replicated) width.
        super().__init__(hidden, (q + 2 * kv) * world, bias)

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            start, size, offset = self.rank * self.q_size, self.q_size, 0
        else:
            # Rank r holds KV head r * total // world (several ranks share a head when replicated).
            head = self.rank * self.total_kv_heads // self.world
            start, size = head * self.head_dim, self.kv_size
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        param.data[offset : offset + size].copy_(loaded[start : start + size])


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input columns split over ranks; partial sums are all-reduced."""

    packable = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.rank, self.world = tp_rank(), tp_size()
        start, end = shard_range(in_features, self.rank, self.world)
        self.weight = nn.Parameter(torch.empty(out_features, end - start), requires_grad=False)
        self.weight.weight_loader = self.load_sharded  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        start, end = shard_range(loaded.shape[1], self.rank, self.world)
        param.data.copy_(loaded[:, start:end])

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        y = linear(x, self.weight)
        if lora is not None:  # this rank's partial LoRA term joins the partial sums before the all-reduce
            y = lora.add(self, x, y)
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
