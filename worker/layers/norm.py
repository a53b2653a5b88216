from __future__ import annotations

import ctypes
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import cpu_kernel


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as the HF Llama reference does), optionally fused with a residual add."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self._lib: ctypes.CDLL | Literal[False] | None = None  # the CPU kernels; False: not to be used

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same math as below in one call (a step runs 2 per layer)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; the second is the next residual. Float32 rows on the
        CPU go through one C call (``cpu_norm.c``) where the CPU kernels could be built: torch's add, reduction
        and multiplies cost a decode step more than its attention did."""
        if self._lib is None:  # looked up on the first call, when the weight is where it stays
            self._lib = (cpu_kernel.load() if self.weight.device.type == "cpu" else None) or False
        if self._lib and cpu_kernel.supports_norm(x, residual, self.weight):
            return cpu_kernel.add_rms_norm(self._lib, x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
