"""Runs the model for one scheduled step: builds the ragged batch, owns the KV cache tensors.

On CUDA (one rank), decode-only steps replay CUDA graphs captured at start-up for a set of batch sizes, the batch
padded up to the nearest one (``DecodeGraphs``), with LoRA adapters too (a second set of graphs through the masked
LoRA path); everything else runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from common.model_config import ModelConfig
from worker.attention import AttentionBackend, AttentionMetadata, ForwardContext
from worker.distributed import all_reduce_min, recv_plan, send_plan, tp_rank, tp_size
from worker.kv_tier_store import TierStore, model_fingerprint
from worker.kv_tiers import KVTiersConfig, StagePlan, TierOps
from worker.lora import LoraBatch, LoraManager
from worker.models.llama import LlamaForCausalLM
from worker.scheduler import ScheduledSeq

_log = logging.getLogger("kvgrid.worker")


class StepInputs(NamedTuple):
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows of the batch whose logits are sampled
    # (source, destination) KV blocks copied before the step computes: the copy-on-write of a forked
    # sequence's last partial block (n > 1, see KVCacheManager.fork)
    block_copies: tuple[tuple[int, int], ...] = ()
    kv_ops: TierOps | None = None  # KV tier copies, run first (offloads read blocks this step overwrites)
    # LoRA: each sequence's adapter slot (-1: the base model; empty: no adapter in the step), and the adapters
    # every rank loads into their slots before computing, (id, path, slot)
    seq_loras: tuple[int, ...] = ()
    lora_loads: tuple[tuple[str, str, int], ...] = ()


def kv_heads_per_rank(mcfg: ModelConfig) -> int:
    return max(1, mcfg.num_kv_heads // tp_size())


def bytes_per_block(mcfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block, all layers, on this rank."""
    elem = torch.empty((), dtype=dtype).element_size()
    return mcfg.num_layers * 2 * block_size * kv_heads_per_rank(mcfg) * mcfg.head_dim * elem


def load_model(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    files = sorted(Path(mcfg.path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{mcfg.path}: no *.safetensors weights")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(default)

    def tensors():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)

    model.load_weights(tensors())
    return model.eval()


class ModelRunner:
    def __init__(
        self,
        mcfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        backend: AttentionBackend,
    ) -> None:
        self.mcfg, self.device, self.dtype = mcfg, device, dtype
        self.block_size = block_size
        self.backend = backend
        self.model = load_model(mcfg, device, dtype)
        self.kv_cache = torch.empty(0)
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        self.lora: LoraManager | None = None  # set by enable_lora
        self.decode_threads: int | None = None  # CPU threads of a decode-only step; None: no change per step
        self.linear_path: str | None = None  # CPU float32: how linears multiply (pick_float32_path), once chosen
        self._step_threads: int | None = None  # the thread count the engine thread was given (read at its first step)
        self.tiers: TierStore | None = None  # host RAM and disk under the KV cache (enable_kv_tiers)
        self.tier_load_s = 0.0  # what the last step's tier loads took
        # Rank 0's engine queues a step's disk writes itself, once the step's tokens are out (Engine.step);
        # the other ranks right after their forward pass.
        self.defer_tier_writes = False

    def allocate_kv_cache(self, num_blocks: int | None, cpu_bytes: int, gpu_fraction: float) -> int:
        """Allocate the paged K/V tensors and return their block count: ``num_blocks`` if given, else what fits
        in ``cpu_bytes`` (CPU) or in ``gpu_fraction`` of the GPU memory still free after the weights (CUDA)."""
        per_block = bytes_per_block(self.mcfg, self.block_size, self.dtype)
        if num_blocks is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * gpu_fraction)
            else:
                budget = cpu_bytes
            # Every rank must hold the same blocks: take the smallest count any rank can afford.
            num_blocks = all_reduce_min(budget // per_block)
            if num_blocks < 1:
                raise ValueError(f"a KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        m = self.mcfg
        shape = (m.num_layers, 2, num_blocks, self.block_size, kv_heads_per_rank(m), m.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        return num_blocks

    def enable_lora(self, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        """Adapter slots (none allocated until the first adapter loads); call before packing the weights."""
        if max_loras > 0:
            self.lora = LoraManager(self.model, self.mcfg, max_loras, max_rank, max_cpu_loras, self.device, self.dtype)

    def enable_kv_tiers(self, config: KVTiersConfig, secret: bytes | str) -> TierStore | None:
        """This rank's host and disk tiers (call after ``allocate_kv_cache``); None when ``config`` has none."""
        if not config.enabled:
            return None
        fp = model_fingerprint(self.mcfg, self.model, self.dtype, self.block_size, tp_size(), tp_rank())
        shape = self.kv_cache.shape
        block_shape = (shape[0], shape[1], *shape[3:])
        self.tiers = TierStore(config, block_shape, self.dtype, self.device, fp, secret, tp_size(), tp_rank())
        return self.tiers

    def stage_kv(self, plan: StagePlan) -> int:
        """Every rank reads the plan's disk blocks into host RAM; returns how many leading blocks every rank
        read (a block one rank could not read is a miss for all, and its files go)."""
        send_plan(plan)
        return self._stage_local(plan)

    def _stage_local(self, plan: StagePlan) -> int:
        assert self.tiers is not None
        n = all_reduce_min(self.tiers.stage(plan))
        if n < len(plan.blocks):
            self.tiers.delete(plan.blocks[n][1])
        return n

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        """The step's plan in plain lists: what rank 0 sends to the other ranks of its group."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, tables, rows = [0], [], [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            table = seq.block_ids
            tables.append(table)
            if n == 1:  # a decode: one token, no ranges to build
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start : start + n])
                pos.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                rows.append(qsl[-1] - 1)
        inp = StepInputs(ids, pos, slots, qsl, seq_lens, tables, rows)
        if self.lora is not None and any(seq.adapter is not None for seq, _ in batch):
            lora = self.lora
            inp = inp._replace(
                seq_loras=tuple(-1 if s.adapter is None else lora.slot_of(s.adapter.id) for s, _ in batch)
            )
        return inp

    @torch.inference_mode()
    def execute(self, inp: StepInputs) -> torch.Tensor:
        """Run the model on a prepared step; returns float32 logits of the sampled rows, in batch order."""
        if inp.kv_ops:
            assert self.tiers is not None
            self.tier_load_s = self.tiers.apply(self.kv_cache, inp.kv_ops)
        if inp.lora_loads:
            assert self.lora is not None
            self.lora.apply(inp.lora_loads)
        if not inp.input_ids:  # tier copies only
            if self.tiers is not None:
                self.tiers.write_pending()
            return torch.empty(0, self.mcfg.vocab_size, dtype=torch.float32)
        self.pick_threads(inp)
        if inp.block_copies:
            self.copy_blocks(inp.block_copies)
        if self.graphs is not None and self.graphs.fits(inp):
            hidden = self.graphs.run(inp)
        else:
            lora = LoraBatch(inp.seq_loras, inp.query_start_loc, self.device) if inp.seq_loras else None
            hidden = self._forward(inp) if lora is None else self._forward(inp, lora)
        if self.tiers is not None and not self.defer_tier_writes:
            self.tiers.write_pending()
        if not inp.sample_rows:
            return hidden.new_empty(0, self.mcfg.vocab_size, dtype=torch.float32)
        if len(inp.sample_rows) < hidden.shape[0]:  # a decode-only step samples every row: no gather
            hidden = hidden[torch.tensor(inp.sample_rows, device=self.device)]
        return self.model.compute_logits(hidden)

    def pick_threads(self, inp: StepInputs) -> None:
        """On CPU with ``decode_threads`` set: a decode-only step runs on that many intra-op threads (at most the
        engine thread's own count), every other step on all of them. Measured through HTTP on 2 cores with the
        gateway beside the rank: decode on 2 threads waited on the core the HTTP path was using, and ran slower
        than on 1; a long prefill still gains from both."""
        if self.decode_threads is None or self.device.type != "cpu":
            return
        if self._step_threads is None:
            self._step_threads = torch.get_num_threads()
        decode = len(inp.input_ids) == len(inp.seq_lens)
        want = min(self.decode_threads, self._step_threads) if decode else self._step_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _forward(self, inp: StepInputs, lora: LoraBatch | None = None) -> torch.Tensor:
        dev = self.device
        n = len(inp.input_ids)
        # Every per-token and per-sequence vector in one host tensor and one copy to the device, then views.
        flat = torch.tensor(
            inp.input_ids + inp.positions + inp.slot_mapping + inp.query_start_loc + inp.seq_lens, dtype=torch.int64
        )
        if dev.type != "cpu":
            flat = flat.pin_memory().to(dev, non_blocking=True)
        num_seqs = len(inp.seq_lens)
        input_ids, positions, slots = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        qsl = flat[3 * n : 3 * n + num_seqs + 1].to(torch.int32)
        seq_lens = flat[3 * n + num_seqs + 1 :].to(torch.int32)
        qlens = [b - a for a, b in zip(inp.query_start_loc, inp.query_start_loc[1:])]
        md = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=_block_table(inp.block_tables, max(map(len, inp.block_tables))).to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(inp.seq_lens),
            query_lens_cpu=qlens,
            seq_lens_cpu=inp.seq_lens,
        )
        return self.model(input_ids, positions, ForwardContext(self.backend, self.kv_cache, md, lora))

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode graphs (CUDA, a backend whose kernels can be captured), with LoRA ones when the
        adapter slots were allocated at the start (``EngineConfig.lora_graphs``); else stay eager. One rank
        only: with tensor parallelism every rank would have to capture its collectives in lockstep, which this
        does not arrange, so a tensor-parallel group runs eagerly."""
        if self.device.type == "cuda" and tp_size() == 1 and self.backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(self, graph_batch_sizes(max_num_seqs), -(-max_model_len // self.block_size))
            self.graphs.capture()

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole KV blocks (every layer, K and V) from each source to its destination."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def run(
        self,
        batch: list[ScheduledSeq],
        block_copies: tuple[tuple[int, int], ...] = (),
        kv_ops: TierOps | None = None,
        lora_loads: tuple[tuple[str, str, int], ...] = (),
    ) -> torch.Tensor:
        """Rank 0's step: plan it, hand the plan to the other ranks, and compute its own shard (after the
        KV tier copies ``kv_ops`` and the adapter loads ``lora_loads``)."""
        self.tier_load_s = 0.0
        inp = self.prepare(batch) if batch else StepInputs([], [], [], [0], [], [], [])
        if block_copies:
            inp = inp._replace(block_copies=block_copies)
        if kv_ops:
            inp = inp._replace(kv_ops=kv_ops)
        if lora_loads:
            inp = inp._replace(lora_loads=lora_loads)
        send_plan(inp)
        return self.execute(inp)

    def follow(self) -> None:
        """Ranks > 0: execute rank 0's plans until it sends ``None`` (shutdown), then wait for this rank's queued
        disk-tier writes, as rank 0's ``Engine.close`` does for its own, so a restart finds every rank's files."""
        while (inp := recv_plan()) is not None:
            if isinstance(inp, StagePlan):
                self._stage_local(inp)
            else:
                self.execute(inp)
        if self.tiers is not None:
            self.tiers.close()


def _block_table(tables: list[list[int]], width: int) -> torch.Tensor:
    """[len(tables), width] int32, each row padded with block 0."""
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


# -- CUDA graphs for decode steps -------------------------------------------------------------------------------

_MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to ``max_num_seqs`` (at most
    256, beyond which a step is long enough that launching its kernels eagerly costs little), which is included
    so that every batch up to it has a graph."""
    top = min(max_num_seqs, _MAX_GRAPH_BATCH)
    return sorted({s for s in (1, 2, 4, 8, *range(16, top, 16)) if s < top} | {top})


def pick_graph_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` sequences (None: more than the largest)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def pad_decode_inputs(inp: StepInputs, size: int) -> StepInputs:
    """A decode-only step padded to ``size`` sequences. A padding sequence is one token (id 0, position 0) over a
    context of one key in block 0, and its slot is -1, which the KV write skips: it computes a row nobody reads
    and changes nothing in the cache."""
    pad = size - len(inp.input_ids)
    n = len(inp.input_ids)
    return StepInputs(
        input_ids=inp.input_ids + [0] * pad,
        positions=inp.positions + [0] * pad,
        slot_mapping=inp.slot_mapping + [-1] * pad,
        query_start_loc=list(range(size + 1)),
        seq_lens=inp.seq_lens + [1] * pad,
        block_tables=inp.block_tables + [[0]] * pad,
        sample_rows=list(range(n)),
        seq_loras=inp.seq_loras + (-1,) * pad if inp.seq_loras else (),  # (no adapter: a zero LoRA term)
    )


class DecodeGraphs:
    """Decode steps as CUDA graph replays: one graph per batch size in ``sizes``, all reading static input
    buffers that each step fills (padded, ``pad_decode_inputs``). The graphs are captured with the longest
    context (``max_blocks`` blocks), so launch-time choices made from it (split-KV) suit any context.

    With the adapter slots allocated at the start (``EngineConfig.lora_graphs``), a second graph per size adds
    every projection's masked LoRA term (``LoraBatch.masked``: every token times all ``max_loras`` slots' rows,
    the other slots' terms zeroed), reading the static ``lora_slots`` (each row's slot, -1 for the base model and
    the padding rows) and the slot tensors, which adapter loads fill in place. A step without adapters replays
    the plain graph: the masked term costs two matmuls over every slot's ``max_rank`` rows per projection even
    when all of it is zeroed."""

    def __init__(self, runner: ModelRunner, sizes: list[int], max_blocks: int) -> None:
        self.runner, self.sizes, self.max_blocks = runner, sizes, max_blocks
        dev, top = runner.device, sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)
        self.lora_slots: torch.Tensor | None = None  # each row's adapter slot (LoRA enabled)
        if runner.lora is not None and runner.lora.allocated:  # (EngineConfig.lora_graphs: slots made at the start)
            self.lora_slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        # (size, with LoRA) -> the graph and its output; a step with adapters fits only if its LoRA graph exists
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.with_lora = False  # the LoRA graphs were captured

    def fits(self, inp: StepInputs) -> bool:
        """A decode-only step (one token per sequence) of at most the largest captured size, without adapters
        or with the LoRA graphs captured."""
        return len(inp.input_ids) == len(inp.seq_lens) <= self.sizes[-1] and (self.with_lora or not inp.seq_loras)

    def load(self, inp: StepInputs) -> int:
        """Copy a step into the static buffers (a step with adapters: each row's slot into ``lora_slots`` too);
        returns the captured size it is padded to."""
        size = pick_graph_size(len(inp.seq_lens), self.sizes)
        assert size is not None
        p = pad_decode_inputs(inp, size)
        rows = [p.input_ids, p.positions, p.slot_mapping, p.seq_lens]
        if p.seq_loras:
            rows.append(list(p.seq_loras))
        vecs = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
        vecs = vecs.to(self.runner.device, non_blocking=True).view(len(rows), size)
        self.input_ids[:size].copy_(vecs[0])
        self.positions[:size].copy_(vecs[1])
        self.slots[:size].copy_(vecs[2])
        self.seq_lens[:size].copy_(vecs[3])
        if p.seq_loras:
            assert self.lora_slots is not None
            self.lora_slots[:size].copy_(vecs[4])
        # Only the columns the longest row uses: building and copying all max_blocks columns (thousands, for a long
        # max_model_len) cost tens of ms per step. What is left past a row's length from earlier steps is stale
        # but never read (keys past seq_len are masked), and a padding row reads only its column 0.
        width = max(map(len, p.block_tables))
        self.block_tables[:size, :width].copy_(_block_table(p.block_tables, width), non_blocking=True)
        return size

    def forward(self, size: int, lora: bool = False) -> torch.Tensor:
        """The model over the first ``size`` rows of the static buffers (what each graph captures), with the
        masked LoRA term of ``lora_slots`` if ``lora``."""
        md = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.runner.block_size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_blocks * self.runner.block_size] * size,
        )
        r = self.runner
        batch = None
        if lora:
            assert self.lora_slots is not None and r.lora is not None
            batch = LoraBatch.masked(self.lora_slots[:size], r.lora.max_loras)
        ctx = ForwardContext(r.backend, r.kv_cache, md, batch)
        return r.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """The plain graphs, then (LoRA enabled) the LoRA ones in the same memory pool; should a LoRA capture
        fail, steps with adapters stay eager and the plain graphs serve on."""
        pool = self._capture(False, None)
        if self.lora_slots is None:
            return
        assert self.runner.lora is not None
        stream = torch.cuda.current_stream(self.runner.device)
        try:
            self._capture(True, pool)
        except Exception:  # (out of memory, say)
            _log.exception("CUDA graphs with LoRA could not be captured: decode steps with adapters run eagerly")
            torch.cuda.set_stream(stream)  # (a capture that failed in capture_end leaves its side stream current)
            for size in self.sizes:
                self.graphs.pop((size, True), None)
        else:
            self.with_lora = True

    def _capture(self, lora: bool, pool: Any) -> Any:
        """Capture one graph per size (with or without the LoRA term) into ``pool``; returns the pool."""
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self.forward(size, lora)  # compiles the kernels, outside the capture (slots are -1: nothing is written)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size, lora)
            pool = graph.pool()
            self.graphs[(size, lora)] = (graph, out)
        return pool

    def run(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states of the step's sequences (the padding rows dropped)."""
        graph, out = self.graphs[(self.load(inp), bool(inp.seq_loras))]
        graph.replay()
        return out[: len(inp.seq_lens)]
