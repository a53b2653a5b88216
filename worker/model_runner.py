"""Runs the model for one scheduled step: builds the ragged batch, owns the KV cache tensors."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from common.model_config import ModelConfig
from worker.attention import AttentionBackend, AttentionMetadata, ForwardContext
from worker.distributed import all_reduce_min, recv_plan, send_plan, tp_size
from worker.models.llama import LlamaForCausalLM
from worker.scheduler import ScheduledSeq


class StepInputs(NamedTuple):
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows of the batch whose logits are sampled


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
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                rows.append(qsl[-1] - 1)
        return StepInputs(ids, pos, slots, qsl, seq_lens, tables, rows)

    @torch.inference_mode()
    def execute(self, inp: StepInputs) -> torch.Tensor:
        """Run the model on a prepared step; returns float32 logits of the sampled rows, in batch order."""
        dev = self.device
        width = max(len(t) for t in inp.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inp.block_tables], dtype=torch.int32)
        qlens = [b - a for a, b in zip(inp.query_start_loc, inp.query_start_loc[1:])]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(inp.query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(inp.seq_lens),
            query_lens_cpu=qlens,
            seq_lens_cpu=inp.seq_lens,
        )
        ctx = ForwardContext(self.backend, self.kv_cache, md)
        hidden = self.model(torch.tensor(inp.input_ids, device=dev), torch.tensor(inp.positions, device=dev), ctx)
        if not inp.sample_rows:
            return hidden.new_empty(0, self.mcfg.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(inp.sample_rows, device=dev)])

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Rank 0's step: plan it, hand the plan to the other ranks, and compute its own shard."""
        inp = self.prepare(batch)
        send_plan(inp)
        return self.execute(inp)

    def follow(self) -> None:
        """Ranks > 0: execute rank 0's plans until it sends ``None`` (shutdown)."""
        while (inp := recv_plan()) is not None:
            self.execute(inp)
