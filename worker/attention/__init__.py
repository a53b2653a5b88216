"""Attention backends. ``auto`` picks Triton on CUDA (once its kernels exist) and torch everywhere else."""

from __future__ import annotations

from worker.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, PagedAttention
from worker.attention.torch_backend import TorchBackend

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, device: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "triton":
        raise ValueError("the triton attention backend is not built yet; use 'torch' or 'auto'")
    return TorchBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "PagedAttention", "TorchBackend", "get_backend", "BACKENDS"]
