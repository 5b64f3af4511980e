"""The loss training minimises: label-smoothed cross-entropy, §5.4 (Szegedy et al. 2016):
epsilon_ls of the probability mass spread uniformly over the vocabulary, padding ignored.

Training runs the output layer (§3.4) fused with it (:func:`projected_label_smoothed_loss`):
the (n, V) logits are made and consumed chunk by chunk of rows and never exist as a whole, and
the gradients are made in the forward (hand-derived autograd Functions). R-Drop's loss (not in
the paper, :func:`rdrop_loss`) is fused the same way. :func:`label_smoothed_loss` is the same
loss on logits a caller already has (the benchmarks' peer uses it), built from the same chunk
kernels; ``tests/reference.py`` holds the plain float64 form all of them are checked against.
"""

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
# on a CPU the output layer's gradient is made this many logits at a time (64 MiB of float32),
# then folded into the gradients of x, W and b: the (n, V) gradient of a 3,125-token batch at
# V = 37,000 would hold 460 MB in every training process (four processes on a 4.5M-pair WMT
# corpus, docs/benchmarks.md). The fused loss's forward and backward at 3,125 tokens and that V
# took 0.90x (d_model 64) and 1.03x (d_model 512) the CPU time of one block (one thread, min of
# 4, process CPU time; bf16 class, a busy machine). On CUDA the whole (n, V) gradient is made
# at once (one product each; the GPU's memory is not the limit there).
_GRAD_BLOCK_ELEMENTS = 2**24


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

def _wants_grad(ctx, bias: Tensor | None) -> bool:
    """Whether a projected loss's forward must build the gradient of x, W or b."""
    return ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or (
        bias is not None and ctx.needs_input_grad[2])


def _project(x: Tensor, w_t: Tensor, bias: Tensor | None, lo: int, hi: int,
             out: Tensor | None = None) -> Tensor:
    """Logits x W^T + b of rows lo..hi, (hi - lo, V), into ``out`` when given."""
    if bias is None:
        return torch.mm(x[lo:hi], w_t, out=out)
    return torch.addmm(bias, x[lo:hi], w_t, out=out)


def _output_layer_grads(ctx, grad: Tensor | None, x: Tensor, weight: Tensor,
                        bias: Tensor | None, grad_scale: float) -> tuple:
    """From the logits' gradient ``grad`` (m, V) (None: none wanted), the gradients of x
    (m, d), W (V, d) and b (V,) that the inputs need, each times ``grad_scale`` (applied to
    these small results, not to the (m, V) rows)."""
    if grad is None:
        return None, None, None
    grads = (grad @ weight if ctx.needs_input_grad[0] else None,
             grad.t() @ x if ctx.needs_input_grad[1] else None,
             grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None)
    if grad_scale != 1.0:
        grads = tuple(None if t is None else t.mul_(grad_scale) for t in grads)
    return grads


def _stored_grads(ctx, grad_loss: Tensor, n_options: int) -> tuple:
    """A projected loss's backward: the gradients its forward stored, times the incoming
    ``grad_loss``; None for its ``n_options`` non-tensor arguments. The stored gradients are
    kept, so a graph retained (retain_graph=True) may run again."""
    return (*(_scaled(t, grad_loss) for t in ctx.grads), *(None,) * n_options)


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """The output layer (§3.4) and the label-smoothed loss in one pass over chunks of rows.

    For each chunk of ``rows`` hidden states, logits = x W^T + b are made in a (rows, V) scratch
    that stays in cache, the loss terms and ``softmax - q`` are taken from it as in
    :class:`_SmoothedCrossEntropy`, and that gradient goes into a (m, V) workspace reused from
    one call to the next, m = n on CUDA, at most ``_GRAD_BLOCK_ELEMENTS / V`` rows on a CPU.
    Two matrix products after each block of m rows give (or add to) the gradients of x and W,
    so no (n, V) logits tensor is ever allocated or read back from memory, and the
    workspace's pages are touched once per process instead of being mapped afresh every step.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, gold: Tensor,
                epsilon_ls: float, grad_scale: float) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(x.dtype, torch.float32)
        n, vocab = x.shape[0], weight.shape[0]
        want = _wants_grad(ctx, bias)
        block = n if x.device.type == "cuda" or not want else \
            min(n, max(_chunk_rows(vocab, x.device), _GRAD_BLOCK_ELEMENTS // vocab))
        grad = _workspace(block * vocab, x.dtype, x.device)[: block * vocab].view(block, vocab) \
            if want else None
        w_t = weight.t()
        rows = min(block, _chunk_rows(vocab, x.device)) or 1
        scratch = torch.empty(rows, vocab, dtype=x.dtype, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            if block >= n:  # one block: the gradient of every row at once
                nll_sum, smooth_sum = _chunked_loss(
                    n, vocab, lambda lo, hi: _project(x, w_t, bias, lo, hi, scratch[: hi - lo]),
                    gold, epsilon_ls, 1.0, acc, grad)
                ctx.grads = _output_layer_grads(ctx, grad, x, weight, bias, grad_scale)
            else:
                nll_sum, smooth_sum, ctx.grads = _blocked_output_layer(
                    ctx, x, weight, bias, w_t, gold, epsilon_ls, grad_scale, acc, grad, scratch)
        ctx.mark_non_differentiable(nll_sum)
        return _combine(nll_sum, smooth_sum, epsilon_ls), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        return _stored_grads(ctx, grad_loss, 3)


def _blocked_output_layer(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, w_t: Tensor,
                         gold: Tensor, epsilon_ls: float, grad_scale: float,
                         acc: torch.dtype, grad: Tensor, scratch: Tensor) -> tuple:
    """:class:`_ProjectedSmoothedCrossEntropy`'s forward over blocks of ``len(grad)`` rows:
    the loss sums, and the gradients of x (rows of each block), W and b (summed over the
    blocks in ``acc``, float32 at least), each times ``grad_scale``."""
    n, vocab = x.shape[0], weight.shape[0]
    block = grad.shape[0]
    gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
    gw = torch.zeros(weight.shape, dtype=acc, device=x.device) \
        if ctx.needs_input_grad[1] else None
    gb = torch.zeros(vocab, dtype=acc, device=x.device) \
        if bias is not None and ctx.needs_input_grad[2] else None
    nll_sum = torch.zeros((), dtype=acc, device=x.device)
    smooth_sum = torch.zeros((), dtype=acc, device=x.device)
    for start in range(0, n, block):
        end = min(n, start + block)
        g = grad[: end - start]
        nll, smooth = _chunked_loss(
            end - start, vocab,
            lambda lo, hi, s=start: _project(x, w_t, bias, s + lo, s + hi, scratch[: hi - lo]),
            gold[start:end], epsilon_ls, 1.0, acc, g)
        nll_sum += nll
        smooth_sum += smooth
        if gx is not None:
            torch.mm(g, weight, out=gx[start:end])
        if gw is not None:
            if acc == x.dtype:
                gw.addmm_(g.t(), x[start:end])  # in place: no (V, d) temporary
            else:  # bf16 products (autocast), summed in float32
                gw += g.t() @ x[start:end]
        if gb is not None:
            gb += g.sum(0, dtype=acc)
    grads = (gx, None if gw is None else gw.to(weight.dtype),
             None if gb is None else gb.to(bias.dtype))
    if grad_scale != 1.0:
        grads = tuple(None if t is None else t.mul_(grad_scale) for t in grads)
    return nll_sum, smooth_sum, grads


_workspaces: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat scratch tensor of at least ``numel`` elements, kept for the next call (grown by
    a quarter when too small), so its memory is not handed back to the system each step."""
    key = (dtype, device)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        _workspaces[key] = ws
    return ws


def projected_label_smoothed_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, epsilon_ls: float,
    pad_id: int, grad_scale: float = 1.0,
) -> tuple[Tensor, Tensor, int]:
    """The output layer (§3.4) and the label-smoothed loss (§5.4) fused, for training.

    The same figures and gradients as ``label_smoothed_loss(F.linear(hidden, weight, bias),
    ...)``, computed chunk by chunk of rows so that the (n, V) logits never exist as a whole
    (see :class:`_ProjectedSmoothedCrossEntropy`). Under ``torch.autocast`` the products run
    in the autocast dtype (bf16 here), as ``F.linear`` would; the soft-max and sums run in
    float32 (float64 for float64 inputs). The gradients of ``hidden``, ``weight`` and
    ``bias`` are made in the forward; the backward only scales them.

    Args:
        hidden: (n, d_model) decoder outputs of the positions to score (the input of the
            pre-softmax linear map).
        weight: (V, d_model), the output projection (tied to the target embedding).
        bias: (V,) or None. Tokens whose bias is -inf (``ModelConfig.output_vocab =
            "target"``, or an imported model's unused rows) can take no probability mass:
            their rows of ``weight`` are left out of the product, the soft-max and the label
            smoothing (epsilon_ls is spread over the other tokens), and positions whose gold
            token is one of them cannot be scored and are dropped from the sums and from
            ``n_tokens``.
        target: (n,) gold ids; positions equal to ``pad_id`` are dropped.
        grad_scale: as in :func:`label_smoothed_loss`.

    Returns:
        (loss_sum, nll_sum, n_tokens), as :func:`label_smoothed_loss`; ``n_tokens`` counts
        the scored positions.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or target.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (n, d), weight (V, d), target (n,); got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}")
    hidden, weight, bias, target = _scored_positions(hidden, weight, bias, target, pad_id)
    loss_sum, nll_sum = _ProjectedSmoothedCrossEntropy.apply(hidden, weight, bias, target,
                                                             epsilon_ls, grad_scale)
    return loss_sum, nll_sum, int(target.numel())


def _scored_positions(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                      pad_id: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The output layer's inputs for the positions that can be scored: padding dropped, the
    vocabulary restricted to the tokens of finite bias (:func:`_restrict_to_finite_bias`),
    and hidden, weight and bias in one dtype (the autocast dtype under autocast)."""
    mask = target != pad_id
    if not bool(mask.all()):
        hidden, target = hidden[mask], target[mask]
    if bias is not None and not bool(torch.isfinite(bias).all()):
        hidden, weight, bias, target = _restrict_to_finite_bias(hidden, weight, bias, target)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    return hidden, weight, bias, target


def _restrict_to_finite_bias(hidden: Tensor, weight: Tensor, bias: Tensor,
                             target: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The output layer over the k tokens whose bias is finite: (n', d) hidden states,
    (k, d) rows of ``weight`` (gathered, so the gradient still reaches the full matrix),
    their (k,) bias (None when all zero) and the (n',) gold ids renumbered into 0..k-1.
    Positions whose gold token has a -inf bias are dropped (n' <= n)."""
    kept = torch.isfinite(bias).nonzero().squeeze(1)  # (k,)
    position = torch.full(bias.shape, -1, dtype=torch.long, device=bias.device)
    position[kept] = torch.arange(kept.numel(), device=bias.device)
    target = position[target]
    scorable = target >= 0
    if not bool(scorable.all()):
        hidden, target = hidden[scorable], target[scorable]
    bias = bias[kept]
    return hidden, weight.index_select(0, kept), (bias if bool(bias.any()) else None), target


def rdrop_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, epsilon_ls: float,
    alpha: float, pad_id: int, grad_scale: float = 1.0,
) -> tuple[Tensor, Tensor, int]:
    """R-Drop (Liang et al. 2021, "R-Drop: Regularized Dropout for Neural Networks"; not in
    the paper): the label-smoothed loss (§5.4) of two forward passes of one batch, which differ
    only in their dropout masks, plus ``alpha`` times the symmetric KL divergence of their
    output distributions, for training.

    Per scored position t, with P1, P2 the two passes' distributions over the output vocabulary
    and CE the label-smoothed cross-entropy, the loss is the R-Drop paper's eq. 3 halved::

        (CE(P1) + CE(P2)) / 2 + alpha / 2 * (KL(P1 || P2) + KL(P2 || P1)) / 2

    so that at ``alpha = 0`` it is the mean of the two passes' ordinary losses, on the scale
    of :func:`projected_label_smoothed_loss`. Like that function it runs the output layer
    chunk by chunk of positions, both passes' rows of a chunk together (the KL term needs both
    whole distributions), and computes the gradient in closed form in the forward, so no
    (2n, V) logits are kept for autograd.

    Args:
        hidden: (2n, d_model) decoder outputs: rows 0..n-1 from the first pass, rows n..2n-1
            the same positions from the second.
        weight: (V, d_model), the output projection (tied to the target embedding).
        bias: (V,) or None; tokens with a -inf bias are left out, as in
            :func:`projected_label_smoothed_loss`.
        target: (n,) gold ids of the positions (the same for both passes); positions equal
            to ``pad_id`` are dropped.
        epsilon_ls: label smoothing (§5.4), in [0, 1).
        alpha: the weight of the KL term, >= 0.
        pad_id: the padding id in ``target``.
        grad_scale: ``loss_sum.backward()`` gives the gradient of ``grad_scale * loss_sum``;
            the returned loss itself is not scaled.

    Returns:
        (loss_sum, nll_sum, n_tokens): the loss above and the two passes' mean negative
        log-likelihood, summed over the n_tokens scored positions (float32 scalars, float64
        for float64 inputs; nll_sum carries no gradient).

    Raises:
        ValueError: shapes that do not fit together, or a negative ``alpha``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or target.dim() != 1 or hidden.shape[0] != 2 * target.shape[0]:
        raise ValueError(f"expected hidden (2n, d), weight (V, d), target (n,); got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}")
    if alpha < 0:
        raise ValueError(f"rdrop alpha must be >= 0, got {alpha}")
    # masks and renumbering act on the target, which both halves share, so the halves stay
    # row-aligned: row i of the first half and row i of the second are the same position
    target = torch.cat([target, target])
    hidden, weight, bias, target = _scored_positions(hidden, weight, bias, target, pad_id)
    loss, nll = _ProjectedRDrop.apply(hidden, weight, bias, target[: target.numel() // 2],
                                      epsilon_ls, alpha, grad_scale)
    return loss, nll, int(target.numel()) // 2


def _rdrop_chunk(z1: Tensor, z2: Tensor, gold: Tensor, epsilon_ls: float, alpha: float,
                 out1: Tensor | None, out2: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """R-Drop's terms for one chunk of r positions, from the two passes' (r, V) logits ``z1``
    and ``z2`` already in the accumulation dtype: the summed nll and uniform term of both
    passes, and their summed symmetric KL. With ``out1`` / ``out2`` (r, V) given, the gradient
    of :func:`rdrop_loss`'s loss (unscaled) with respect to each pass's logits is written
    there, in closed form: with d = log P1 - log P2 and s1 = sum_v P1 d,

        d/dz1 [KL(P1 || P2) + KL(P2 || P1)] = P1 (d - s1) + P1 - P2

    and the mirror image for z2; the label-smoothed term gives (P - q) / 2 for each pass."""
    vocab = z1.shape[1]
    g = gold.unsqueeze(1)
    lp1, lp2 = z1.log_softmax(dim=-1), z2.log_softmax(dim=-1)
    nll = -(lp1.gather(1, g).sum() + lp2.gather(1, g).sum())
    smooth = -(lp1.sum() + lp2.sum()) / vocab if epsilon_ls > 0 else torch.zeros_like(nll)
    p1, p2 = lp1.exp(), lp2.exp()
    d = lp1.sub_(lp2)  # log P1 - log P2, in place of log P1
    diff = p1 - p2
    sym_kl = (diff * d).sum()
    if out1 is None or out2 is None:
        return nll, smooth, sym_kl
    c = 0.25 * alpha
    for p, sign, out in ((p1, 1.0, out1), (p2, -1.0, out2)):
        s = (p * d).sum(dim=1, keepdim=True) * sign  # (r, 1)
        # c (p (sign d - s) + sign (P1 - P2)) + (p - q) / 2
        grad = torch.addcmul(p * (0.5 - c * s), p, d, value=c * sign)
        grad.add_(diff, alpha=c * sign)
        _subtract_smoothed_target(grad, g, epsilon_ls, 0.5)
        out.copy_(grad)
    return nll, smooth, sym_kl


class _ProjectedRDrop(torch.autograd.Function):
    """The output layer and R-Drop's loss (:func:`rdrop_loss`) in one pass over chunks of
    positions, as :class:`_ProjectedSmoothedCrossEntropy` does for the plain loss: each chunk's
    logits of both passes are made in cache, its loss terms and closed-form gradient taken
    from them (:func:`_rdrop_chunk`), and two matrix products after the loop give the
    gradients of x and W, so no (2n, V) tensor is kept for autograd."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, gold: Tensor,
                epsilon_ls: float, alpha: float, grad_scale: float) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(x.dtype, torch.float32)
        n, vocab = gold.shape[0], weight.shape[0]
        grad = _workspace(2 * n * vocab, x.dtype, x.device)[: 2 * n * vocab].view(2 * n, vocab) \
            if _wants_grad(ctx, bias) else None
        w_t = weight.t()
        rows = max(1, min(n, _chunk_rows(vocab, x.device) // 2))
        nll_sum = torch.zeros((), dtype=acc, device=x.device)
        smooth_sum, kl_sum = torch.zeros_like(nll_sum), torch.zeros_like(nll_sum)
        with torch.autocast(x.device.type, enabled=False):
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                nll, smooth, kl = _rdrop_chunk(
                    _project(x, w_t, bias, lo, hi).to(acc),
                    _project(x, w_t, bias, n + lo, n + hi).to(acc), gold[lo:hi], epsilon_ls,
                    alpha, None if grad is None else grad[lo:hi],
                    None if grad is None else grad[n + lo:n + hi])
                nll_sum += nll
                smooth_sum += smooth
                kl_sum += kl
            ctx.grads = _output_layer_grads(ctx, grad, x, weight, bias, grad_scale)
        loss = 0.5 * _combine(nll_sum, smooth_sum, epsilon_ls) + 0.25 * alpha * kl_sum
        nll_mean = 0.5 * nll_sum
        ctx.mark_non_differentiable(nll_mean)
        return loss, nll_mean

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        return _stored_grads(ctx, grad_loss, 4)
