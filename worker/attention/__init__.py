"""Attention backends. ``auto`` picks Triton on CUDA and torch everywhere else; ``triton`` and ``torch`` force
one. On CPU the Triton backend runs only under ``TRITON_INTERPRET=1`` (slowly: it is how it is tested)."""

from __future__ import annotations

import os

from worker.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, PagedAttention
from worker.attention.torch_backend import TorchBackend

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, device: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device != "cuda"):
        return TorchBackend()
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs CUDA, or TRITON_INTERPRET=1 to run on CPU")
    # Imported here: the interpreter setting must be in place before any @triton.jit module loads.
    from worker.attention.triton_backend import TritonBackend

    return TritonBackend()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "PagedAttention",
    "TorchBackend",
    "get_backend",
    "BACKENDS",
]
