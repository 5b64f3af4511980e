"""Plain reference implementations the model is checked against (STYLE.md §5: the math
attention lives in tests/, not as a runtime branch of the model).

Everything here is written for clarity, straight from the paper, and computes in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Eq. 1, §3.2.1: softmax(Q K^T / sqrt(d_k)) V, in float64.

    Args:
        q: (..., Tq, d_k); k: (..., Tk, d_k); v: (..., Tk, d_v).
        mask: bool, broadcastable to (..., Tq, Tk), True where attention is allowed; illegal
            connections get a logit of -inf before the softmax (§3.2.3).

    Returns:
        (..., Tq, d_v), float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    d_k = q.shape[-1]
    logits = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., Tq, Tk)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def causal_mask(length: int) -> Tensor:
    """(length, length) bool, True at (i, j) when j <= i: position i sees positions < i+1."""
    return torch.ones(length, length, dtype=torch.bool).tril()


def multi_head(mha, query: Tensor, key_value: Tensor, mask: Tensor | None = None) -> Tensor:
    """§3.2.2 MultiHead(Q, K, V) = Concat(head_1 … head_h) W^O, one head at a time, float64,
    using the weights of an ``aiayn.model.MultiHeadAttention`` ``mha``.

    Args:
        query: (B, Tq, d_model); key_value: (B, Tk, d_model).
        mask: bool broadcastable to (B, Tq, Tk), True = may attend.

    Returns:
        (B, Tq, d_model), float64.
    """
    def linear(layer, x: Tensor) -> Tensor:
        return x.double() @ layer.weight.double().T + layer.bias.double()

    Q, K, V = linear(mha.W_q, query), linear(mha.W_k, key_value), linear(mha.W_v, key_value)
    heads = []
    for i in range(mha.h):
        qi = Q[..., i * mha.d_k:(i + 1) * mha.d_k]
        ki = K[..., i * mha.d_k:(i + 1) * mha.d_k]
        vi = V[..., i * mha.d_v:(i + 1) * mha.d_v]
        heads.append(attention(qi, ki, vi, mask))
    return linear(mha.W_o, torch.cat(heads, dim=-1))


def sinusoid(pos: int, j: int, d_model: int) -> float:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle)."""
    two_i = j - (j % 2)
    angle = pos / 10000 ** (two_i / d_model)
    return math.sin(angle) if j % 2 == 0 else math.cos(angle)


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon_ls: float,
                        pad_id: int) -> tuple[Tensor, Tensor, int]:
    """§5.4 label smoothing, in float64: the cross-entropy of the model's distribution with
    q = (1 - epsilon_ls) one_hot(gold) + epsilon_ls / V, summed over the non-pad targets.

    Args:
        logits: (..., V); target: (...) gold ids, ``pad_id`` where nothing is predicted.

    Returns:
        (loss_sum, nll_sum, n_tokens), float64 scalars.
    """
    keep = target != pad_id
    logp = torch.log_softmax(logits[keep].double(), dim=-1)  # (n, V)
    q = torch.full_like(logp, epsilon_ls / logp.shape[-1])
    q[torch.arange(len(q)), target[keep]] += 1.0 - epsilon_ls
    nll = -logp.gather(1, target[keep][:, None]).sum()
    return -(q * logp).sum(), nll, int(keep.sum())
