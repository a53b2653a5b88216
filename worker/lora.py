"""Batched LoRA: PEFT adapters in a fixed number of device slots, applied per token by slot in one step.

Each LoRA-capable projection (fused Q/K/V, o_proj, fused gate/up, down_proj) gets, once the first adapter is
loaded (at start-up with decode graphs), two stacked tensors over the slots: ``A`` [slots, k * max_rank, in] and
``Bt`` [slots, k * max_rank, out] (B transposed, the adapter's scaling folded in), ``k`` the sub-projections the
module fuses. A slot packs the targets its adapter has, ``rank`` rows each, and records the rows used (``width``):
a step multiplies only those (``LoraBatch.add``), so neither the padding to ``max_rank`` nor an untargeted projection
costs anything.

A decode step replayed from a CUDA graph needs fixed shapes: there every token is multiplied by every slot's rows
and the terms of the slots it does not run under are zeroed (``LoraBatch.masked``), which B's layout (each
sub-target's rows already write only their own output columns) turns into the same sum.

Tensor parallel: a column-parallel module takes this rank's rows of B (the slices its base weight loader takes)
and A whole; a row-parallel one takes this rank's columns of A and B whole, and adds its term before the
all-reduce (the partial sums over ranks add up to the full ``B A x``).

Slots are assigned on rank 0 (``assign``: least recently used first, never one the running requests use) and the
step plan carries ``(id, path, slot)`` of each load, so every rank loads the same adapter into the same slot
(``apply``). Evicted adapters stay in host memory (``max_cpu_loras`` of them, least recently used dropped), then
are read from their folder again.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file
from torch import nn

from common.lora import WEIGHTS_FILE, AdapterError, AdapterRef, AdapterSpec, read_adapter
from common.model_config import ModelConfig

# Our fused module -> (its PEFT sub-targets in output order, the base weight loader's shard ids, row-parallel?)
_MODULES: dict[str, tuple[tuple[str, ...], tuple[object, ...], bool]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), ("q", "k", "v"), False),
    "o_proj": (("o_proj",), (None,), True),
    "gate_up_proj": (("gate_proj", "up_proj"), (0, 1), False),
    "down_proj": (("down_proj",), (None,), True),
}
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


def target_shapes(mcfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's full (unsharded) weight shape, [out, in]."""
    h, q, kv, i = (
        mcfg.hidden_size,
        mcfg.num_heads * mcfg.head_dim,
        mcfg.num_kv_heads * mcfg.head_dim,
        mcfg.intermediate_size,
    )
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }  # fmt: skip


@dataclass
class AdapterWeights:
    """An adapter's tensors on the host, float32: (layer, target) -> (A [r, in], scaling * B [out, r])."""

    spec: AdapterSpec
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(spec: AdapterSpec, mcfg: ModelConfig, dtype: torch.dtype = torch.float32) -> AdapterWeights:
    """Read and check an adapter's weights against the model (every layer of every target, exact shapes, finite in
    ``dtype``: the masked path multiplies every slot's weights by zero for other adapters' tokens, and an
    infinite weight would turn that zero into NaN)."""
    where = f"adapter {spec.path!r}"
    try:
        raw = load_file(str(Path(spec.path) / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc})") from None
    shapes = target_shapes(mcfg)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in raw.items():
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds {name!r}, which is not a LoRA A/B weight of a layer")
        layer, target, ab = int(m[1]), m[2], m[3]
        if target not in spec.targets:
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds {name!r}, a module target_modules does not list")
        if layer >= mcfg.num_layers:
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds {name!r}, but the model has {mcfg.num_layers} layers")
        out, inp = shapes[target]
        want = (spec.rank, inp) if ab == "A" else (out, spec.rank)
        if tuple(t.shape) != want:
            raise AdapterError(
                f"{where}: {WEIGHTS_FILE}: {name!r} has shape {list(t.shape)}; this model needs {list(want)}"
            )
        found[(layer, target, ab)] = t
    tensors = {}
    for layer in range(mcfg.num_layers):
        for target in spec.targets:
            a, b = found.get((layer, target, "A")), found.get((layer, target, "B"))
            if a is None or b is None:
                missing = "lora_A" if a is None else "lora_B"
                raise AdapterError(f"{where}: {WEIGHTS_FILE} lacks layer {layer}'s {target}.{missing}")
            a, b = a.float().contiguous(), (b.float() * spec.scaling).contiguous()
            if not (a.to(dtype).isfinite().all() and b.to(dtype).isfinite().all()):
                raise AdapterError(f"{where}: layer {layer}'s {target} has weights that are not finite in {dtype}")
            tensors[(layer, target)] = (a, b)
    return AdapterWeights(spec, tensors)


class ModuleLora:
    """One projection's stacked slots (allocated with the first adapter) and the rows each slot uses."""

    def __init__(self, layer: int, name: str, module: nn.Module, max_loras: int, max_rank: int) -> None:
        self.layer = layer
        self.module: Any = module  # (its ``load_sharded``: mypy reads an nn.Module attribute as a tensor)
        self.targets, self.shard_ids, self.row = _MODULES[name]
        weight = module.weight
        assert isinstance(weight, torch.Tensor) and weight.numel(), "enable LoRA before packing the weights"
        self.out_features, self.in_features = weight.shape  # this rank's shard
        self.rows = len(self.targets) * max_rank
        self.max_loras = max_loras
        self.width = [0] * max_loras
        self.A = self.Bt = torch.empty(0)

    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """Once: the decode graphs capture these tensors' addresses, so loads copy into them, never replace them."""
        shape = (self.max_loras, self.rows)
        self.A = torch.zeros(*shape, self.in_features, device=device, dtype=dtype)
        self.Bt = torch.zeros(*shape, self.out_features, device=device, dtype=dtype)

    def write(self, slot: int, w: AdapterWeights) -> None:
        """Put this rank's shard of ``w``'s targets of this module into ``slot``."""
        r = w.spec.rank
        j = 0
        self.A[slot].zero_()  # rows past the new adapter's width must be zero (padded steps multiply them)
        self.Bt[slot].zero_()
        load = self.module.load_sharded  # the base weight's loader: the same slice of each tensor
        for target, sid in zip(self.targets, self.shard_ids):
            if target not in w.spec.targets:
                continue
            a, b = w.tensors[(self.layer, target)]
            if self.row:  # this rank's columns of A, B whole
                a_part = torch.empty(r, self.in_features)
                load(a_part, a)
                b_part = b
            else:  # A whole, this rank's rows of B at the module's offset of this target
                a_part = a
                b_part = torch.zeros(self.out_features, r)
                load(b_part, b, sid)
            self.A[slot, j * r : (j + 1) * r].copy_(a_part)
            self.Bt[slot, j * r : (j + 1) * r].copy_(b_part.T)
            j += 1
        self.width[slot] = j * r


class LoraBatch:
    """Which adapter slot each token of a step runs under, and the LoRA term of each projection for them.

        Three ways to add it, chosen once per step by how the tokens lie: a couple of runs of one slot each (two
        matmuls per run); many tokens of several slots in similar numbers, a decode step say (``padded``: each slot's
        rows gathered into an equal-length group, padded with copies of the group's first row, then one batched matmul
        pair over the slots, about five kernels per projection whatever the adapter count, two when the engine's
    sorting by slot left equal groups in order); else (a long prefill beside
        short ones, where padding would cost) the rows gathered by slot and two matmuls per slot."""

    def __init__(self, seq_slots: tuple[int, ...], query_start_loc: list[int], device: torch.device) -> None:
        # Runs of consecutive tokens under one slot (a request's tokens are contiguous; neighbours may share).
        runs: list[tuple[int, int, int]] = []
        for s, a, b in zip(seq_slots, query_start_loc, query_start_loc[1:]):
            if s < 0:
                continue
            if runs and runs[-1][0] == s and runs[-1][2] == a:
                runs[-1] = (s, runs[-1][1], b)
            else:
                runs.append((s, a, b))
        self.runs = runs
        self.perm: torch.Tensor | None = None  # the gathered rows (padded: [slots * longest group])
        self.padded = False
        self.drop: torch.Tensor | None = None  # masked: [tokens, slots, 1], True where a token's term is zeroed
        self.slots = sorted({s for s, _, _ in runs})
        if len(runs) <= 2:
            return
        groups = {s: [r for rs, a, b in runs if rs == s for r in range(a, b)] for s in self.slots}
        longest = max(map(len, groups.values()))
        if len(groups) * longest <= 2 * sum(map(len, groups.values())):
            # A padding row repeats its group's first row (any row would do: its term is masked to zero).
            self.padded, self.group = True, longest
            rows = [r for g in groups.values() for r in g + [g[0]] * (longest - len(g))]
            lo, hi = self.slots[0], self.slots[-1] + 1
            self.slot_range = (lo, hi) if self.slots == list(range(lo, hi)) else None
            self.slot_index = torch.tensor(self.slots, dtype=torch.int64, device=device)
            # Every token in equal groups in slot order (the engine sorts a step by slot): views, no gather.
            self.identity = rows == list(range(query_start_loc[-1]))
            pad = [[[i >= len(g)] for i in range(longest)] for g in groups.values()]
            self.pad = torch.tensor(pad, device=device) if any(len(g) < longest for g in groups.values()) else None
        else:
            rows, self.segments = [], []
            for s, g in groups.items():
                self.segments.append((s, len(rows), len(rows) + len(g)))
                rows.extend(g)
        self.perm = torch.tensor(rows, dtype=torch.int64, device=device)

    @classmethod
    def masked(cls, seq_slots: torch.Tensor, max_loras: int) -> LoraBatch:
        """The static-shape form, for one token per sequence (a decode step replayed from a CUDA graph): each
        token times every slot's rows, the other slots' terms zeroed. ``seq_slots`` [tokens] is a device tensor
        (slot -1: the base model, or a padding row); only its values change between replays."""
        batch = cls((), [0], seq_slots.device)
        batch.drop = (seq_slots[:, None] != torch.arange(max_loras, device=seq_slots.device))[:, :, None]
        return batch

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus ``x A[s]^T B[s]^T`` for the tokens of each slot ``s``."""
        lw: ModuleLora | None = getattr(module, "lora", None)
        if lw is None:
            return y
        if self.drop is not None:
            slots, rows = lw.A.shape[:2]
            t = x @ lw.A.view(slots * rows, -1).T
            # A fill, not a product with a 0/1 mask: another slot's term may overflow, and inf * 0 is NaN.
            t.view(-1, slots, rows).masked_fill_(self.drop, 0)
            return y.addmm_(t, lw.Bt.view(slots * rows, -1))
        if self.perm is None:
            for s, a, b in self.runs:
                w = lw.width[s]
                if w:
                    y[a:b].addmm_(x[a:b] @ lw.A[s, :w].T, lw.Bt[s, :w])
            return y
        if self.padded:
            w = max(lw.width[s] for s in self.slots)  # (a slot's rows past its own width are zero)
            if not w:
                return y
            if self.slot_range is not None:  # consecutive slots: views, no copy of the weights
                lo, hi = self.slot_range
                wa, wbt = lw.A[lo:hi, :w], lw.Bt[lo:hi, :w]
            else:
                wa, wbt = lw.A[:, :w].index_select(0, self.slot_index), lw.Bt[:, :w].index_select(0, self.slot_index)
            n, g = len(self.slots), self.group
            if self.identity:
                y.view(n, g, -1).baddbmm_(torch.bmm(x.reshape(n, g, -1), wa.transpose(1, 2)), wbt)
                return y
            t = torch.bmm(x.index_select(0, self.perm).view(n, g, -1), wa.transpose(1, 2))
            if self.pad is not None:  # a padding row adds nothing (it repeats a row of its group)
                t.masked_fill_(self.pad, 0)
            return y.index_add_(0, self.perm, torch.bmm(t, wbt).view(n * g, -1))
        xs = x.index_select(0, self.perm)
        ys = y.new_zeros(xs.shape[0], y.shape[1])
        for s, a0, b0 in self.segments:
            w = lw.width[s]
            if w:
                ys[a0:b0].addmm_(xs[a0:b0] @ lw.A[s, :w].T, lw.Bt[s, :w])
        return y.index_add_(0, self.perm, ys)


class LoraManager:
    """The model's adapter slots on this rank, the host copies, and (rank 0) which adapter each slot is for."""

    def __init__(
        self,
        model: nn.Module,
        mcfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.mcfg, self.device, self.dtype = mcfg, device, dtype
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.modules: list[ModuleLora] = []
        for i, layer in enumerate(cast(Any, model).model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name in _MODULES:
                    module = getattr(parent, name, None)
                    if module is not None:
                        module.lora = ModuleLora(i, name, module, max_loras, max_rank)
                        self.modules.append(module.lora)
        self.allocated = False
        self.owner: list[str | None] = [None] * max_loras  # rank 0: the adapter each slot is assigned to
        self.loaded: list[str | None] = [None] * max_loras  # what each slot's tensors hold (every rank)
        self._used = [0] * max_loras  # when each slot was last assigned to a step (a step counter)
        self._tick = 0
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()

    def resident(self) -> list[str]:
        """The ids of the adapters loaded in device slots."""
        return [a for a in self.loaded if a is not None]

    def allocate(self) -> None:
        """Room for every slot in every projection (once; zeros: an empty slot adds nothing)."""
        if not self.allocated:
            for m in self.modules:
                m.allocate(self.device, self.dtype)
            self.allocated = True

    def slot_of(self, adapter_id: str) -> int:
        return self.owner.index(adapter_id)

    def check(self, ref: AdapterRef) -> AdapterRef:
        """Rank 0, at admission: check the adapter folder and its weights against the model and keep a host copy;
        returns the reference with the id of what the folder holds. ``AdapterError`` (a ``ValueError``) else."""
        spec = read_adapter(ref.path, self.max_rank)
        if ref.id and ref.id != spec.id:
            raise AdapterError(f"adapter {ref.path!r}: id {ref.id!r} does not match the folder's content ({spec.id})")
        self._host_copy(spec.id, ref.path, spec)
        return ref if ref.id == spec.id else AdapterRef(spec.id, ref.path)

    def _host_copy(self, adapter_id: str, path: str, spec: AdapterSpec | None = None) -> AdapterWeights:
        w = self.host.get(adapter_id)
        if w is not None:
            self.host.move_to_end(adapter_id)
            return w
        spec = spec or read_adapter(path, self.max_rank)
        if spec.id != adapter_id:
            raise AdapterError(
                f"adapter {path!r}: the folder changed since it was admitted (id {spec.id}, not {adapter_id})"
            )
        w = load_adapter(spec, self.mcfg, self.dtype)
        if self.max_cpu_loras > 0:
            self.host[adapter_id] = w
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        return w

    def assign(self, wanted: dict[str, str], keep: set[str]) -> tuple[tuple[str, str, int], ...]:
        """Rank 0, each step: a slot for every adapter of the batch (``wanted``: id -> path); a new one takes a free
        slot, else the least recently used one that no running request's adapter (``keep``) holds. Returns the
        loads to make, (id, path, slot); the scheduler keeps the running requests' adapters within the slots."""
        self._tick += 1
        loads = []
        for adapter_id, path in wanted.items():
            if adapter_id in self.owner:
                self._used[self.owner.index(adapter_id)] = self._tick
                continue
            free = [i for i, o in enumerate(self.owner) if o is None or (o not in keep and o not in wanted)]
            if not free:
                raise RuntimeError(f"no LoRA slot left for adapter {adapter_id} (max_loras {self.max_loras})")
            slot = min(free, key=lambda i: (self.owner[i] is not None, self._used[i]))
            self.owner[slot], self._used[slot] = adapter_id, self._tick
            loads.append((adapter_id, path, slot))
        return tuple(loads)

    def apply(self, loads: tuple[tuple[str, str, int], ...]) -> None:
        """Every rank, before the step computes: load each (id, path, slot) not already there."""
        for adapter_id, path, slot in loads:
            if self.loaded[slot] == adapter_id:
                continue
            w = self._host_copy(adapter_id, path)
            self.allocate()  # the first adapter's load, unless the decode graphs allocated the slots at start-up
            self.loaded[slot] = None
            for m in self.modules:
                m.write(slot, w)
            self.loaded[slot] = adapter_id
