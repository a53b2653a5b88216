"""worker/attention/torch_backend.py: the decode gather buffers, reused across steps but not kept at a peak size."""

from __future__ import annotations

import torch

from worker.attention.torch_backend import TorchBackend


def gather(backend: TorchBackend, rows: torch.Tensor, n: int) -> torch.Tensor:
    index = torch.arange(n) % rows.shape[0]
    out = backend._gather(0, rows, index)
    torch.testing.assert_close(out, rows[index])
    return out


def test_a_peak_sized_buffer_is_given_back_once_steps_need_far_less():
    backend = TorchBackend()
    backend.keep_bytes = 4096  # stands for the real budget (tens of MiB) at test sizes
    rows = torch.randn(50, 64)  # 256 bytes a row
    gather(backend, rows, 400)  # the peak step: 100 KiB
    peak = backend._gathered[0]
    assert peak.numel() == 400 * 64
    gather(backend, rows, 250)  # still over half of it: reused
    assert backend._gathered[0] is peak
    gather(backend, rows, 100)  # a quarter: reallocated to fit
    assert backend._gathered[0].numel() == 100 * 64
    gather(backend, rows, 4)  # 1 KiB: reallocated again
    small = backend._gathered[0]
    assert small.numel() == 4 * 64
    gather(backend, rows, 1)  # under the byte budget the buffer is kept, however much bigger than the need
    assert backend._gathered[0] is small
