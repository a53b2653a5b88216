"""Tensor-parallel communication. With no process group (one rank) every collective is the identity.

A group's ranks share one default process group (NCCL on CUDA, gloo on CPU). Rank 0 also sends each step's
plan, a picklable object, to the others over a gloo group (objects travel on the CPU whatever the device).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

_plan_group: Any = None


def init_tensor_parallel(rank: int, world: int, init_method: str, backend: str, timeout_s: float = 120.0) -> None:
    """Join this process to its group. A dead peer fails collectives after at most ``timeout_s``."""
    global _plan_group
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    # Followers wait for the next plan as long as the group is idle: that wait must not time out (a stuck
    # step is rank 0's step timeout's business; a dead rank 0 closes the connection).
    _plan_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def send_plan(plan: object) -> None:
    if tp_size() > 1:
        dist.broadcast_object_list([plan], src=0, group=_plan_group)


def recv_plan() -> Any:
    buf: list[Any] = [None]
    dist.broadcast_object_list(buf, src=0, group=_plan_group)
    return buf[0]


def all_reduce_min(value: int) -> int:
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_plan_group)
    return int(t.item())


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's shard along ``dim`` (vocab-parallel logits)."""
    world = tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def shard_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s equal share of ``total`` (which must divide evenly)."""
    if total % world:
        raise ValueError(f"{total} does not split evenly over {world} ranks")
    per = total // world
    return rank * per, (rank + 1) * per
