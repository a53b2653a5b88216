"""Runs the model for one scheduled step: builds the ragged batch, owns the KV cache tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from common.model_config import ModelConfig
from worker.attention import AttentionBackend, AttentionMetadata, ForwardContext
from worker.distributed import tp_size
from worker.models.llama import LlamaForCausalLM
from worker.scheduler import ScheduledSeq


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
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ValueError(f"a KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        m = self.mcfg
        shape = (m.num_layers, 2, num_blocks, self.block_size, kv_heads_per_rank(m), m.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return num_blocks

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, qlens, sample_rows = [0], [], [], []
        max_blocks = max(len(s.seq.block_table) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            table = seq.block_ids
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            qlens.append(n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), md, sample_rows

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the step and return float32 logits for the sequences that reach their last token, in
        batch order."""
        input_ids, positions, md, rows = self._prepare(batch)
        ctx = ForwardContext(self.backend, self.kv_cache, md)
        hidden = self.model(input_ids, positions, ctx)
        if not rows:
            return hidden.new_empty(0, self.mcfg.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
