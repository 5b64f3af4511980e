"""The fused output layer + loss on a CPU makes the (n, V) gradient a block of rows at a time
(aiayn.training.loss._GRAD_BLOCK_ELEMENTS): the same loss and gradients as in one block, and a
workspace bounded by the block, not by the batch (issue 81: training memory per process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.training import loss as loss_module
from aiayn.training.loss import projected_label_smoothed_loss


def run(hidden, weight, bias, target, eps, scale):
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    loss, nll, n = projected_label_smoothed_loss(hidden, weight, bias, target, eps, 0, scale)
    return loss, nll, n, torch.autograd.grad(3.0 * loss, inputs)


@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_of_rows_give_the_loss_and_gradients_of_one_block(with_bias, monkeypatch):
    torch.manual_seed(3)
    hidden = torch.randn(45, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(29, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(29, dtype=torch.float64, requires_grad=True) if with_bias else None
    target = torch.randint(1, 29, (45,))
    target[::4] = 0  # padding, dropped: 33 rows scored
    monkeypatch.setattr(loss_module, "_CHUNK_ELEMENTS", 7 * 29)  # chunks of 7 rows
    one = run(hidden, weight, bias, target, 0.1, 0.25)
    monkeypatch.setattr(loss_module, "_GRAD_BLOCK_ELEMENTS", 10 * 29)  # blocks of 10 rows
    loss_module._workspaces.clear()
    blocked = run(hidden, weight, bias, target, 0.1, 0.25)
    assert blocked[2] == one[2] == 33
    torch.testing.assert_close(blocked[0], one[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(blocked[1], one[1], rtol=1e-12, atol=0)
    for a, b in zip(blocked[3], one[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    ref = F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=0,
                          label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(blocked[0], ref, rtol=1e-10, atol=0)
    (ws,) = loss_module._workspaces.values()
    assert ws.numel() <= 10 * 29 * 5 // 4  # the block's rows, not the batch's 33


def test_bf16_blocks_sum_the_weight_gradient_in_float32(monkeypatch):
    torch.manual_seed(4)
    hidden = torch.randn(300, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    target = torch.randint(1, 50, (300,))
    exact = run(hidden, weight, None, target, 0.1, 1.0)[3]
    monkeypatch.setattr(loss_module, "_GRAD_BLOCK_ELEMENTS", 20 * 50)  # 15 blocks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        blocked = run(hidden, weight, None, target, 0.1, 1.0)[3]
    monkeypatch.setattr(loss_module, "_GRAD_BLOCK_ELEMENTS", 2**24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = run(hidden, weight, None, target, 0.1, 1.0)[3]
    for b, w, e in zip(blocked, whole, exact, strict=True):
        # the blocks are no further from the float32 gradient than one bf16 block is
        assert (b.float() - e).norm() <= 1.5 * (w.float() - e).norm() + 1e-6
