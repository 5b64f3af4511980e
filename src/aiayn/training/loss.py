"""Label-smoothed cross-entropy, §5.4 (Szegedy et al. 2016): epsilon_ls of the probability mass
spread uniformly over the vocabulary, padding ignored. The reference loss, on logits; the
training loop runs the output layer and this loss fused (:mod:`aiayn.training.fused_loss`),
which these chunk helpers also serve."""

from __future__ import annotations

import torch
from torch import Tensor


# logits handled at once, by device. On a CPU ~4 MB of float32 at V = 8000, so each chunk's
# soft-max, sums and scatter run in cache instead of streaming (n, V) float32 arrays through
# memory. On CUDA each chunk is a handful of kernel launches, and small chunks leave the GPU
# idle: on an H100 (base, V = 37,000, 25k target tokens, bf16; bench/bench_wmt_step.py) the
# loss took 204 ms a step at 2**20 logits a chunk, 52 at 2**22, 25 at 2**24, 20 at 2**26.
_CHUNK_ELEMENTS = 2**20
_CHUNK_ELEMENTS_CUDA = 2**26


def _smoothed_chunk(logits: Tensor, gold: Tensor, epsilon_ls: float, grad_scale: float,
                    buffer: Tensor, want_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss terms of one chunk of rows, (r, V) logits and (r,) gold ids: the summed negative
    log-likelihood, the summed uniform term -sum(log p) / V, and (when ``want_grad``) the
    gradient ``grad_scale * (softmax - q)`` written into ``buffer`` (r, V), float32 or float64.

    One exponential per logit: the soft-max is taken once, and the log-sum-exp of each row
    comes from its largest probability, lse = max - log(p_max), which is at least 1 / V and so
    never underflows. Then log p_gold = logit_gold - lse and sum(log p) = sum(logits) - V lse,
    without the (r, V) log-probabilities that a ``log_softmax`` followed by ``exp`` would write.
    """
    vocab = logits.shape[1]
    dtype = buffer.dtype
    g = gold.unsqueeze(1)
    probs = torch.softmax(logits, dim=-1, dtype=dtype, out=buffer)  # (r, V)
    # amax, not max: max's indices cost ~6x more on bf16 here, and p_max is max(probs)
    lse = logits.amax(dim=1, keepdim=True).to(dtype) - probs.amax(dim=1, keepdim=True).log_()
    nll = (lse - logits.gather(1, g).to(dtype)).sum()
    smooth = lse.sum() - logits.sum(dtype=dtype) / vocab if epsilon_ls > 0 \
        else torch.zeros_like(nll)
    if not want_grad:
        return nll, smooth, None
    if grad_scale != 1.0:
        probs.mul_(grad_scale)  # in cache, instead of a pass over (n, V) later
    _subtract_smoothed_target(probs, g, epsilon_ls, grad_scale)
    return nll, smooth, probs


def _subtract_smoothed_target(grad: Tensor, g: Tensor, epsilon_ls: float, scale: float) -> None:
    """``grad`` (r, V) minus ``scale`` times the label-smoothed target q of §5.4, in place:
    (1 - epsilon_ls) on the gold ids ``g`` (r, 1) plus epsilon_ls / V on every token."""
    if epsilon_ls > 0:
        grad.sub_(scale * epsilon_ls / grad.shape[1])
    grad.scatter_add_(1, g, torch.full(g.shape, scale * (epsilon_ls - 1.0), dtype=grad.dtype,
                                       device=grad.device))


def _combine(nll_sum: Tensor, smooth_sum: Tensor, epsilon_ls: float) -> Tensor:
    if epsilon_ls > 0:
        return (1.0 - epsilon_ls) * nll_sum + epsilon_ls * smooth_sum
    return nll_sum.clone()


def _chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of (rows, V) logits taken at once on ``device``."""
    elements = _CHUNK_ELEMENTS_CUDA if device.type == "cuda" else _CHUNK_ELEMENTS
    return max(1, elements // vocab)


def _chunked_loss(n: int, vocab: int, logits_of, gold: Tensor, epsilon_ls: float,
                  grad_scale: float, dtype: torch.dtype,
                  grad: Tensor | None) -> tuple[Tensor, Tensor]:
    """Summed nll and uniform term over n rows, taken chunk by chunk of rows; the logits of
    rows lo..hi come from ``logits_of(lo, hi)``; when ``grad`` (n, V) is given, each
    chunk's gradient is written into it. Sums in ``dtype`` (float32 or float64)."""
    device = gold.device
    nll_sum = torch.zeros((), dtype=dtype, device=device)
    smooth_sum = torch.zeros((), dtype=dtype, device=device)
    rows = min(n, _chunk_rows(vocab, device)) or 1
    buffer = torch.empty(rows, vocab, dtype=dtype, device=device)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        nll, smooth, chunk_grad = _smoothed_chunk(logits_of(lo, hi), gold[lo:hi],
                                                  epsilon_ls, grad_scale, buffer[: hi - lo],
                                                  grad is not None)
        nll_sum += nll
        smooth_sum += smooth
        if grad is not None:
            grad[lo:hi] = chunk_grad
    return nll_sum, smooth_sum


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of (n, V) logits, its gradient made in the forward.

    d loss / d logits = softmax - q, with q = (1 - eps) one_hot(gold) + eps / V, does not
    depend on the upstream gradient except through a scalar factor. So the forward computes it
    at once, chunk by chunk of rows: one soft-max in float32 (float64 for float64 logits) per
    chunk gives the gradient and, with each row's log-sum-exp, the gold and uniform terms
    (see :func:`_smoothed_chunk`); the gradient is stored in the logits' dtype (bf16 under
    autocast). The backward only scales it. Compared with saving (n, V) float32
    log-probabilities and exponentiating them again in the backward, this drops one ``exp``
    pass, two dtype casts of (n, V) and the float32 copy held between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, gold: Tensor, epsilon_ls: float,
                grad_scale: float) -> tuple[Tensor, Tensor]:
        # float32 at least (bf16 logits under autocast), float64 kept for reference checks
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n, vocab = logits.shape
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if want_grad else None
        nll_sum, smooth_sum = _chunked_loss(n, vocab, lambda lo, hi: logits[lo:hi], gold,
                                            epsilon_ls, grad_scale, dtype, grad)
        if want_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(nll_sum)
        return _combine(nll_sum, smooth_sum, epsilon_ls), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return _scaled(grad, grad_loss), None, None, None


def _scaled(grad: Tensor | None, grad_loss: Tensor) -> Tensor | None:
    if grad is None or (grad_loss.numel() == 1 and float(grad_loss) == 1.0):
        return grad
    return grad.mul(grad_loss.to(grad.dtype))  # out of place: a retained graph may run again


def label_smoothed_loss(
    logits: Tensor, target: Tensor, epsilon_ls: float, pad_id: int, grad_scale: float = 1.0
) -> tuple[Tensor, Tensor, int]:
    """Label-smoothed cross-entropy (§5.4), summed over the non-pad target tokens.

    The target distribution is (1 - epsilon_ls) on the gold token plus epsilon_ls / V on every
    token; the loss is its cross-entropy with the model's distribution. One soft-max in
    float32 serves both terms and the closed-form gradient softmax - target, computed in the
    forward (about 2.5x faster on CPU than ``F.cross_entropy`` with ``label_smoothing``).

    Args:
        logits: (..., V), any float dtype (bf16 under autocast); the gradient comes back in it.
        target: (...) gold ids, ``pad_id`` where nothing is predicted. Training passes only the
            non-pad positions (``Transformer(..., output_mask=...)``), which skips the masking.
        grad_scale: the gradient that ``loss_sum.backward()`` gives the logits is that of
            ``grad_scale * loss_sum`` (e.g. 1 / tokens per update), folded into the forward's
            pass over the logits; the returned loss itself is not scaled.

    Returns:
        (loss_sum, nll_sum, n_tokens): the smoothed loss and the plain negative log-likelihood,
        both summed over the n_tokens non-pad positions (float32 scalars, float64 for float64
        logits; nll_sum carries no gradient).

    Raises:
        ValueError: ``logits`` is not (..., V) over ``target``'s shape.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match target "
                         f"{tuple(target.shape)} (expected logits (..., V), target (...))")
    mask = target != pad_id
    if bool(mask.all()):
        flat, gold = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    else:
        flat, gold = logits[mask], target[mask]
    loss_sum, nll_sum = _SmoothedCrossEntropy.apply(flat, gold, epsilon_ls, grad_scale)
    return loss_sum, nll_sum, int(gold.numel())
