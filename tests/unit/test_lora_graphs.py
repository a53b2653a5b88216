"""The masked LoRA path that decode graphs replay (worker/lora.py ``LoraBatch.masked``): the same term as the
grouped eager path for any mix of slots, padding rows and the base model adding nothing, and another slot's
overflow kept out of a row's term. Whole engines through the graphs' static buffers: tests/integration/test_lora.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.lora import LoraBatch
from worker.model_runner import StepInputs, pad_decode_inputs


def _slots(widths: list[int], rows: int = 8, inp: int = 16, out: int = 12) -> SimpleNamespace:
    """A module's stacked slots as ModuleLora leaves them: each slot's rows past its width zero."""
    a, bt = torch.randn(len(widths), rows, inp), torch.randn(len(widths), rows, out)
    for s, w in enumerate(widths):
        a[s, w:], bt[s, w:] = 0, 0
    return SimpleNamespace(A=a, Bt=bt, width=widths)


def test_padding_rows_run_under_no_adapter():
    inp = StepInputs([5, 6, 7], [3, 4, 5], [10, 20, 30], [0, 1, 2, 3], [4, 5, 6], [[0], [1], [1]], [0, 1, 2])
    assert pad_decode_inputs(inp, 4).seq_loras == ()  # a step without adapters stays without
    assert pad_decode_inputs(inp._replace(seq_loras=(2, -1, 0)), 5).seq_loras == (2, -1, 0, -1, -1)


def test_each_token_keeps_only_its_own_slot():
    drop = LoraBatch.masked(torch.tensor([1, -1, 0, 2, 1]), 3).drop
    assert drop is not None and drop.shape == (5, 3, 1)
    keep = (~drop[:, :, 0]).int().tolist()
    assert keep == [[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0]]


@pytest.mark.parametrize(
    "seq_slots",
    [
        (0, 1, -1, 0, 2, 1),  # unsorted, the base model between adapters
        (0, 0, 1, 1, 2, 2),  # sorted by slot, equal groups (the eager path's views)
        (2, 2, -1, -1),  # slot 2's adapter does not target this module: nothing added
        (-1, -1, -1),  # no adapter in the batch (what the padding rows are): y unchanged
        (1,),
    ],
)
def test_the_masked_term_equals_the_grouped_one(seq_slots):
    torch.manual_seed(0)
    lw = _slots([4, 8, 0])
    n = len(seq_slots)
    x, y = torch.randn(n, 16), torch.randn(n, 12)
    qsl = list(range(n + 1))
    grouped = LoraBatch(seq_slots, qsl, torch.device("cpu")).add(SimpleNamespace(lora=lw), x, y.clone())
    masked = LoraBatch.masked(torch.tensor(seq_slots), 3).add(SimpleNamespace(lora=lw), x, y.clone())
    torch.testing.assert_close(masked, grouped)
    base = [i for i, s in enumerate(seq_slots) if s < 0 or s == 2]
    assert torch.equal(masked[base], y[base])  # exactly: a zeroed term adds +0


def test_an_overflow_in_another_slot_stays_out_of_a_row():
    lw = _slots([4, 4])
    lw.A[1, :4] = 3e38  # slot 1's first product overflows for every token (finite weights, as load_adapter checks)
    x, y = torch.ones(3, 16), torch.zeros(3, 12)
    out = LoraBatch.masked(torch.tensor([0, -1, 1]), 2).add(SimpleNamespace(lora=lw), x, y)
    assert out[:2].isfinite().all()  # slot 0's token and the base model's: a fill, not inf * 0
    assert not out[2].isfinite().all()  # slot 1's own token sees its overflow, as the eager path would give it
