"""The Transformer of Vaswani et al. (2017), §3, in one file.

Shape legend: B batch, S source length, T target length, t tokens decoded so far,
d d_model, h heads, d_k / d_v per-head sizes, V vocabulary size.

Masks are bool and True means "may attend" (the convention of
``torch.nn.functional.scaled_dot_product_attention``). The source mask ``src_mask`` has shape
(B, S) and is True at real tokens, False at padding. Targets are right-padded, so the causal mask
alone keeps every real target position from seeing padding. Restricted self-attention (§4,
``ModelConfig.attention_window = r``) adds a band: position i sees positions j with |i - j| <= r
(and j <= i in the decoder); encoder-decoder attention stays unrestricted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model.cache import DecoderCache


def sinusoid_table(max_len: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """Positional encodings of §3.5, shape (max_len, d_model), float32.

    PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).
    ``layout="halves"`` (Marian / OPUS-MT) holds the same values with all sines first, then
    all cosines: column i is the sine of frequency i, column ceil(d/2) + i its cosine.
    """
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(d/2),)
    angle = pos / torch.pow(10000.0, two_i / d_model)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    if layout == "halves":
        table = torch.cat([table[:, 0::2], table[:, 1::2]], dim=1)
    elif layout != "interleaved":
        raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
    return table.float()


class PositionalEncoding(nn.Module):
    """Sinusoidal (§3.5) or learned (Table 3 row E) position vectors.

    ``forward(length, offset)`` returns (length, d_model) for positions offset … offset+length-1.
    """

    def __init__(self, d_model: int, max_len: int, learned: bool = False,
                 layout: str = "interleaved") -> None:
        super().__init__()
        self.max_len = max_len
        if learned:
            self.table = nn.Parameter(torch.empty(max_len, d_model).normal_(0.0, d_model**-0.5))
        else:
            self.register_buffer("table", sinusoid_table(max_len, d_model, layout),
                                 persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        if offset + length > self.max_len:
            raise ValueError(
                f"sequence of {offset + length} tokens exceeds the model's max_len={self.max_len}"
            )
        return self.table[offset : offset + length]


class Dropout(nn.Module):
    """Inverted dropout (Srivastava et al. 2014) as §5.4 applies it, with cheaper masks.

    ``nn.Dropout`` draws one float per element through ``bernoulli_``, which on CPU took 14% of a
    Multi30k training step. Here one random int64 gives four 16-bit draws, each compared with
    ``P_drop`` quantized to 1/65536 (0.3 becomes 0.29999...), so a mask costs about a seventh as
    much. It uses torch's default generator, so ``torch.manual_seed`` and the saved RNG state
    make runs reproducible as before. Identity in eval mode, when ``P_drop`` is 0, or while
    ``active`` is False (late dropout: :meth:`Transformer.set_dropout_active`).

    Args:
        P_drop: probability of zeroing an element, in [0, 1).

    Raises:
        ValueError: if ``P_drop`` is outside [0, 1).
    """

    def __init__(self, P_drop: float) -> None:
        super().__init__()
        if not 0.0 <= P_drop < 1.0:
            raise ValueError(f"P_drop must be in [0, 1), got {P_drop}")
        self.P_drop = P_drop
        self.active = True
        # keep an element when its uniform int16 draw is >= this threshold
        self._threshold = -32768 + round(P_drop * 65536)
        self._scale = 65536 / (65536 - round(P_drop * 65536))

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.active) or self.P_drop == 0.0:
            return x
        n = x.numel()
        draws = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64,
                              device=x.device).view(torch.int16)[:n].view(x.shape)
        keep = (draws >= self._threshold).to(x.dtype) * self._scale
        return x * keep

    def extra_repr(self) -> str:
        return f"P_drop={self.P_drop}"


def band_mask(q_len: int, k_len: int, window: int | None, *, causal: bool, q_offset: int = 0,
              k_offset: int = 0, device: torch.device | None = None) -> Tensor:
    """Self-attention mask of restricted self-attention, §4 (and Table 1's r).

    Query i (absolute position ``q_offset + i``) may attend key j (position ``k_offset + j``)
    when the two are at most ``window`` apart, and, if ``causal``, the key is not later.

    Returns:
        bool (q_len, k_len), True = may attend; ``window=None`` gives no band (all, or causal).
    """
    q = torch.arange(q_len, device=device)[:, None] + q_offset
    k = torch.arange(k_len, device=device)[None, :] + k_offset
    diff = q - k  # (q_len, k_len)
    ok = diff.abs() <= window if window is not None else torch.ones_like(diff, dtype=torch.bool)
    return ok & (k <= q) if causal else ok


class MultiHeadAttention(nn.Module):
    """Multi-head attention, §3.2.2: Concat(head_1 … head_h) W^O, head_i = Attention(Q W_i^Q, …).

    d_k and d_v are free of d_model / h so that Table 3 rows (A) and (B) can be built.
    The attention itself is eq. 1, run by ``F.scaled_dot_product_attention`` (decoding's CPU
    engine, :mod:`aiayn.model.engine`, runs it in its own kernel instead).

    Training on CPU also computes eq. 1 explicitly (:meth:`_attend_explicit`): at these
    sentence lengths (~10-30 tokens) it took 10-12% less of a ``multi30k`` step than
    ``scaled_dot_product_attention``'s math kernel (one scaling instead of two, no float mask
    built from the bool one, and the cheap :class:`Dropout` masks instead of ``bernoulli_``).

    Recording (for figures like the paper's Figures 3-5): set ``record_weights = True`` and
    each call computes eq. 1 explicitly in float32, softmax(Q K^T / sqrt(d_k)) with the masks
    applied, uses those weights for its output and keeps them in ``weights`` (B, h, Tq, Tk).
    Off by default, so training and decoding pay one attribute test
    (see :func:`aiayn.viz.attention.record_attention`).
    """

    def __init__(self, d_model: int, h: int, d_k: int, d_v: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.h, self.d_k, self.d_v = h, d_k, d_v
        self.W_q = nn.Linear(d_model, h * d_k)
        self.W_k = nn.Linear(d_model, h * d_k)
        self.W_v = nn.Linear(d_model, h * d_v)
        self.W_o = nn.Linear(h * d_v, d_model)
        self.dropout = dropout
        self.attn_dropout = Dropout(dropout)
        self.record_weights = False
        self.weights: Tensor | None = None

    def _split(self, x: Tensor, size: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.h, size).transpose(1, 2)  # (B, h, L, size)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of ``x`` (B, L, d_model): each (B, h, L, d_k) and (B, h, L, d_v)."""
        return self._split(self.W_k(x), self.d_k), self._split(self.W_v(x), self.d_v)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Self-attention's projections of one input ``x`` (B, L, d_model): the queries
        x W^Q (B, L, h * d_k), for :meth:`forward`'s ``projected``, and the keys and values
        as :meth:`project_kv` gives them."""
        return self.W_q(x), self.project_kv(x)

    def forward(
        self,
        query: Tensor,
        kv: tuple[Tensor, Tensor],
        mask: Tensor | None = None,
        is_causal: bool = False,
        group: int = 1,
        *,
        projected: Tensor | None = None,
    ) -> Tensor:
        """Attend from ``query`` (B, Tq, d_model) over projected keys and values.

        Args:
            query: (B, Tq, d_model), before the W^Q projection.
            kv: keys (B, h, Tk, d_k) and values (B, h, Tk, d_v) from :meth:`project_kv`; with
                ``group`` G > 1, (B / G, …): every G consecutive query rows share one row of
                keys and values (the beams of a sentence over its encoder output), attended
                to as G * Tq queries of one call, so the keys are never copied per beam.
            mask: bool, broadcastable to (B / G, h, G * Tq, Tk), True where attention is
                allowed.
            is_causal: position i attends to keys 0 … i only (decoder self-attention, §3.2.3).
            projected: ``query``'s W^Q projection (B, Tq, h * d_k) when already made
                (:meth:`project_qkv`).

        Returns:
            (B, Tq, d_model).
        """
        q_flat = self.W_q(query) if projected is None else projected  # (B, Tq, h * d_k)
        B, Tq = q_flat.shape[:2]
        k, v = kv
        q = self._split(q_flat, self.d_k)  # (B, h, Tq, d_k)
        if group > 1:  # (B, h, Tq, d_k) -> (B / G, h, G * Tq, d_k)
            q = (q.view(B // group, group, self.h, Tq, self.d_k).transpose(1, 2)
                 .reshape(B // group, self.h, group * Tq, self.d_k))
        if self.record_weights or (self.training and q.device.type == "cpu"):
            out = self._attend_explicit(q, k, v, mask, is_causal)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal,
                dropout_p=self.dropout if self.training and self.attn_dropout.active else 0.0,
            )  # (B, h, Tq, d_v)
        if group > 1:
            out = (out.view(B // group, self.h, group, Tq, self.d_v).transpose(1, 2)
                   .reshape(B, self.h, Tq, self.d_v))
        return self.W_o(out.transpose(1, 2).reshape(B, Tq, self.h * self.d_v))

    def _attend_explicit(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                         is_causal: bool) -> Tensor:
        """Eq. 1 written out: softmax(Q K^T / sqrt(d_k)) V, (B, h, Tq, d_v). When recording,
        in float32, keeping softmax(Q K^T / sqrt(d_k)) in ``self.weights``."""
        out_dtype = v.dtype
        if self.record_weights:
            q, k, v = q.float(), k.float(), v.float()
        scores = (q * self.d_k**-0.5) @ k.transpose(-2, -1)  # (B, h, Tq, Tk)
        if is_causal:  # SDPA's is_causal: query i sees keys 0..i
            Tq, Tk = scores.shape[-2:]
            causal = band_mask(Tq, Tk, None, causal=True, device=q.device)
            mask = causal if mask is None else mask & causal
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        if self.record_weights:
            self.weights = weights.detach()
        if self.training:
            weights = self.attn_dropout(weights)
        return (weights @ v).to(out_dtype)


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, §3.3; (B, L, d_model) -> (B, L, d_model).

    ``activation="swish"`` replaces max(0, ·) by x * sigmoid(x), as OPUS-MT models do.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.W_1 = nn.Linear(d_model, d_ff)
        self.W_2 = nn.Linear(d_ff, d_model)
        self.activation = {"relu": F.relu, "swish": F.silu}[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.W_2(self.activation(self.W_1(x)))


class _Residual(nn.Module):
    """One sub-layer's residual wrapper with dropout where §5.4 puts it.

    post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x)));
    pre-norm (option): x + Dropout(Sublayer(LayerNorm(x))).
    """

    def __init__(self, d_model: int, P_drop: float, pre_norm: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = Dropout(P_drop)
        self.pre_norm = pre_norm

    def inner(self, x: Tensor) -> Tensor:
        """What the sub-layer sees: x itself (post-norm) or LayerNorm(x) (pre-norm)."""
        return self.norm(x) if self.pre_norm else x

    def outer(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        y = x + self.dropout(sublayer_out)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each in a residual block, §3.1."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.d_k, cfg.d_v,
                                            cfg.attention_dropout)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.ffn_activation)
        self.res_attn = _Residual(cfg.d_model, cfg.P_drop, pre, cfg.layer_norm_eps)
        self.res_ffn = _Residual(cfg.d_model, cfg.P_drop, pre, cfg.layer_norm_eps)

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        """x: (B, S, d_model); attn_mask: bool (B, 1, 1, S). Returns (B, S, d_model)."""
        y = self.res_attn.inner(x)
        q, kv = self.self_attn.project_qkv(y)
        x = self.res_attn.outer(x, self.self_attn(y, kv, attn_mask, projected=q))
        return self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN, §3.1."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        args = (cfg.d_model, cfg.h, cfg.d_k, cfg.d_v, cfg.attention_dropout)
        self.self_attn = MultiHeadAttention(*args)
        self.cross_attn = MultiHeadAttention(*args)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.ffn_activation)
        self.res_self = _Residual(cfg.d_model, cfg.P_drop, pre, cfg.layer_norm_eps)
        self.res_cross = _Residual(cfg.d_model, cfg.P_drop, pre, cfg.layer_norm_eps)
        self.res_ffn = _Residual(cfg.d_model, cfg.P_drop, pre, cfg.layer_norm_eps)
        self.window = cfg.attention_window

    def forward(
        self,
        x: Tensor,
        cross_kv: tuple[Tensor, Tensor],
        cross_mask: Tensor | None,
        cache: DecoderCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """x: (B, T, d_model); cross_kv: encoder keys/values (B, h, S, d_k|d_v) of this layer.

        Without a cache, T is the whole (shifted) target and attention is causal. With a cache,
        x holds the new positions only; their keys and values are appended to the cache and
        they attend to everything cached (all earlier positions), so nothing is recomputed.
        With ``attention_window = r`` both paths see only the last r positions and their own.
        """
        y = self.res_self.inner(x)
        q, kv = self.self_attn.project_qkv(y)
        if cache is None and self.window is None:
            attn = self.self_attn(y, kv, is_causal=True, projected=q)
        elif cache is None:
            T = x.shape[1]
            attn = self.self_attn(y, kv, band_mask(T, T, self.window, causal=True,
                                                   device=x.device), projected=q)
        else:
            k_offset = cache.length - cache.cached_len(layer)  # first position still cached
            kv = cache.gathered(*cache.append_self(layer, *kv))  # (B, h, t_all, d_k | d_v)
            mask = None
            t_new, t_all = x.shape[1], kv[0].shape[2]
            if t_new > 1 or (self.window is not None and t_all > self.window + 1):
                mask = band_mask(t_new, t_all, self.window, causal=True, q_offset=cache.length,
                                 k_offset=k_offset, device=x.device)
            attn = self.self_attn(y, kv, mask, projected=q)
        x = self.res_self.outer(x, attn)
        y = self.res_cross.inner(x)
        group = 1 if cache is None else cache.group
        x = self.res_cross.outer(x, self.cross_attn(y, cross_kv, cross_mask, group=group))
        return self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))


_REDUCED = (torch.bfloat16, torch.float16)


class _LookupSummedInFloat32(torch.autograd.Function):
    """Embedding lookup whose backward sums each row's gradients in float32.

    torch's own embedding backward adds a bf16 weight's gradients in bf16: 3,000 rows of 0.01
    for one token sum to 4 instead of 30, because past 256 addends each new 0.01 is below half
    a unit in the last place. Frequent tokens ("a", ".", BOS) occur thousands of times in a
    batch, so training on bf16 weights (``train.bf16_weights``) needs this. The result is
    rounded to the weight's dtype once, at the end. tokens (...) -> (..., d_model).
    """

    @staticmethod
    def forward(ctx, tokens: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.weight_shape = weight.shape
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor]:
        (tokens,) = ctx.saved_tensors
        total = torch.zeros(ctx.weight_shape, dtype=torch.float32, device=grad.device)
        total.index_add_(0, tokens.reshape(-1), grad.reshape(-1, grad.shape[-1]).float())
        return None, total.to(grad.dtype)


def _check_src_mask(src_mask: Tensor, batch_and_len: tuple[int, int]) -> None:
    # SDPA would take a 0/1 float or int mask as an additive bias and mask nothing
    if src_mask.dtype != torch.bool:
        raise TypeError(f"src_mask must be bool (True = real token), got {src_mask.dtype}")
    if tuple(src_mask.shape) != tuple(batch_and_len):
        raise ValueError(f"src_mask has shape {tuple(src_mask.shape)}, expected (B, S) = "
                         f"{tuple(batch_and_len)}")


class Transformer(nn.Module):
    """Encoder-decoder Transformer, §3, configured by :class:`~aiayn.config.ModelConfig`.

    Typical use::

        logits = model(src, tgt_in)                      # training, teacher forcing
        memory, src_mask = model.encode(src)             # decoding
        cache = model.start_cache(memory, src_mask)      # cross-attention K/V computed once
        logits = model.decode_step(tokens, cache)        # (B, t_new, V); [:, -1] is next

    This is the paper's model in torch and nothing else. Decoding on a CPU runs it through
    :mod:`aiayn.model.engine` (the same encode / start_cache / decode_step, in aiayn's
    compiled CPU code, or an int8 copy's), which reads this model's weights and changes nothing.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.src_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.share_embeddings:
            self.tgt_embed = self.src_embed  # §3.4: one matrix for both embeddings and softmax
        else:
            self.tgt_embed = nn.Embedding(cfg.target_vocab_size, cfg.d_model)
        self.positions = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.positional == "learned",
                                            cfg.positional_layout)
        # a fixed (untrained) output bias: Marian's, or -inf on the tokens that
        # ``output_vocab = "target"`` leaves out (see limit_output_vocab); absent in the paper
        if cfg.final_logits_bias or cfg.output_vocab == "target":
            self.register_buffer("final_logits_bias", torch.zeros(cfg.target_vocab_size))
        else:
            self.final_logits_bias = None
        self.embed_dropout = Dropout(cfg.P_drop)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.N))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.N))
        pre = cfg.norm == "pre"  # pre-norm stacks end in a LayerNorm of their own
        self.encoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if pre else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if pre else None
        self.embed_scale = math.sqrt(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, zero biases, N(0, d_model^-0.5) embeddings."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.src_embed.weight, 0.0, self.config.d_model**-0.5)
        if self.tgt_embed is not self.src_embed:
            nn.init.normal_(self.tgt_embed.weight, 0.0, self.config.d_model**-0.5)

    @torch.no_grad()
    def limit_output_vocab(self, token_ids: Tensor) -> None:
        """Let the output layer produce only ``token_ids``: every other token's logit bias
        becomes -inf, so it takes no probability mass when decoding, and the training loss
        leaves its row of the output projection out of the soft-max altogether
        (:func:`aiayn.training.loss.projected_label_smoothed_loss`). Not in the paper.

        Args:
            token_ids: (k,) int ids in [0, V_tgt), e.g. those seen on the target side of the
                training data plus EOS.

        Raises:
            ValueError: the model has no output bias (``output_vocab`` is not "target" and
                ``final_logits_bias`` is off), or an id outside the target vocabulary.
        """
        if self.final_logits_bias is None:
            raise ValueError('limit_output_vocab needs ModelConfig.output_vocab = "target" '
                             "(or final_logits_bias = true)")
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        V = self.final_logits_bias.numel()
        if ids.numel() == 0:
            raise ValueError("output token ids: none given")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"output token ids must be in [0, {V}), got ids in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        bias = torch.full_like(self.final_logits_bias, float("-inf"))
        bias[ids.to(bias.device)] = 0.0
        self.final_logits_bias.copy_(bias)

    def output_token_ids(self, fixed: int) -> Tensor | None:
        """The tokens the output layer can produce, as long (V',) ids in increasing order, with
        ids 0 .. ``fixed`` - 1 always in (so that in a map onto these columns, column i is token
        i for i < ``fixed``: the searches' special ids, PAD, BOS and EOS); None when every token
        can be produced (no ``-inf`` bias).

        A map onto these columns gives every producible token the logit the full map gives it,
        and drops only tokens of probability 0: a search finds the same tokens, for ``V'/V`` of
        the output layer's work (not in the paper; see ``ModelConfig.output_vocab``).
        """
        bias = self.final_logits_bias
        if bias is None or not bool(torch.isinf(bias).any()):
            return None
        keep = torch.isfinite(bias)
        keep[:fixed] = True
        return keep.nonzero().squeeze(1)

    def set_dropout_active(self, active: bool) -> None:
        """Switch all of the model's dropout (``P_drop``, ``attention_dropout`` and
        ``word_dropout``) off or back on for training mode; eval mode never drops. Late dropout
        (Liu et al. 2023, "Dropout Reduces Underfitting"; not in the paper) trains the first part
        of a run without it: :attr:`aiayn.config.TrainConfig.late_dropout_start`.
        """
        for module in self.modules():
            if isinstance(module, Dropout):
                module.active = active

    @property
    def draws_dropout(self) -> bool:
        """Whether a forward pass now draws dropout masks: training mode, dropout switched on
        (:meth:`set_dropout_active`) and some rate above 0 (``ModelConfig.has_dropout``). Two
        forward passes of one batch differ only then (R-Drop, ``train.rdrop_alpha``)."""
        return self.training and self.embed_dropout.active and self.config.has_dropout

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int = 0,
               word_dropout: float = 0.0) -> Tensor:
        # §3.4: embedding weights multiplied by sqrt(d_model); §3.5: positions added;
        # §5.4: dropout on the sum.
        weight = embedding.weight
        if weight.dtype in _REDUCED and weight.requires_grad and torch.is_grad_enabled():
            rows = _LookupSummedInFloat32.apply(tokens, weight)  # bf16 weights (training)
        else:
            rows = embedding(tokens)
        scale: Tensor | float = self.embed_scale
        # word dropout has no module of its own: it follows the embedding dropout's switch
        if word_dropout > 0.0 and self.training and self.embed_dropout.active:
            # whole tokens dropped (their position stays), the kept ones scaled by 1 / (1 - p)
            keep = torch.rand(tokens.shape, device=tokens.device) >= word_dropout  # (B, T)
            scale = keep.unsqueeze(-1).to(rows.dtype) * (self.embed_scale / (1.0 - word_dropout))
        x = rows * scale + self.positions(tokens.shape[1], offset)
        return self.embed_dropout(x)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run the encoder stack.

        Args:
            src: token ids (B, S), right-padded with ``pad_id``.
            src_mask: bool (B, S), True at real tokens; derived from ``pad_id`` when None.

        Returns:
            memory (B, S, d_model) and the (B, S) source mask.
        """
        if src_mask is None:
            src_mask = src != self.config.pad_id
        _check_src_mask(src_mask, src.shape)
        attn_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        if self.config.attention_window is not None:  # §4: a band of width 2r + 1
            S = src.shape[1]
            band = band_mask(S, S, self.config.attention_window, causal=False, device=src.device)
            # each position also sees itself, so a padding row far from any token is not empty
            attn_mask = attn_mask & band | torch.eye(S, dtype=torch.bool, device=src.device)
        x = self._embed(self.src_embed, src, word_dropout=self.config.word_dropout)
        for layer in self.encoder:
            x = layer(x, attn_mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, src_mask

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor,
               output_mask: Tensor | None = None, project: bool = True) -> Tensor:
        """Decoder over a whole shifted-right target (teacher forcing).

        Args:
            tgt_in: (B, T) ids: the output shifted right by one (§3.1), beginning with the
                start token ``config.decoder_start_id`` (BOS by default; pad for a converted
                Marian model). The model does not add it: callers put it in front.
            memory: (B, S, d_model) from :meth:`encode`; src_mask: bool (B, S).
            output_mask: optional bool (B, T): project only these positions (training passes
                the non-pad targets, so padding never reaches the V-wide output layer).
            project: False stops before the pre-softmax linear map and returns its input,
                (B, T, d_model) or (n, d_model), for a loss that applies the map itself
                (:func:`aiayn.training.loss.projected_label_smoothed_loss`).

        Returns:
            logits (B, T, V_tgt), or (n, V_tgt) for the n True positions of ``output_mask``.
        """
        _check_src_mask(src_mask, memory.shape[:2])
        cross_mask = src_mask[:, None, None, :]
        x = self._embed(self.tgt_embed, tgt_in)
        for layer in self.decoder:
            x = layer(x, layer.cross_attn.project_kv(memory), cross_mask)
        if output_mask is not None:
            if output_mask.dtype != torch.bool or output_mask.shape != tgt_in.shape:
                raise ValueError(f"output_mask must be bool of shape {tuple(tgt_in.shape)}, got "
                                 f"{output_mask.dtype} {tuple(output_mask.shape)}")
            x = x[output_mask]
        if not project:
            return x if self.decoder_norm is None else self.decoder_norm(x)
        return self.project(x)

    def project(self, x: Tensor) -> Tensor:
        """Pre-softmax linear map (tied to the target embedding, §3.4): (…, d) -> (…, V_tgt)."""
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return F.linear(x, self.tgt_embed.weight, self.final_logits_bias)

    def forward(self, src: Tensor, tgt_in: Tensor, src_mask: Tensor | None = None,
                output_mask: Tensor | None = None, project: bool = True) -> Tensor:
        """Teacher-forced logits: src (B, S), tgt_in (B, T) -> (B, T, V_tgt), or (n, V_tgt)
        for the n True positions of ``output_mask`` (B, T); with ``project=False`` the
        decoder's output before the pre-softmax map, (…, d_model) (see :meth:`decode`)."""
        memory, src_mask = self.encode(src, src_mask)
        return self.decode(tgt_in, memory, src_mask, output_mask, project)

    def start_cache(self, memory: Tensor, src_mask: Tensor, capacity: int = 0) -> DecoderCache:
        """Incremental decoding state for ``memory`` (B, S, d_model): the encoder-decoder keys
        and values of every layer are computed here, once per source. ``capacity``: decoder
        positions to reserve (the longest output plus its start token, when known; the cache
        grows past it if needed)."""
        cross = [layer.cross_attn.project_kv(memory) for layer in self.decoder]
        return DecoderCache.start(cross, src_mask, window=self.config.attention_window,
                                  capacity=capacity)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Logits for the positions after ``tokens``, reusing and extending ``cache``.

        Args:
            tokens: (B, t_new) ids of the newest positions (usually t_new = 1).
            cache: from :meth:`start_cache`, holding the t positions decoded before; it is
                extended in place by t_new positions.

        Returns:
            logits (B, t_new, V_tgt); ``[:, -1]`` scores the next token.
        """
        cross_mask = cache.src_mask[:, None, None, :]
        x = self._embed(self.tgt_embed, tokens, offset=cache.length)
        for i, layer in enumerate(self.decoder):
            x = layer(x, cache.cross[i], cross_mask, cache=cache, layer=i)
        cache.advance(tokens.shape[1])
        return self.project(x)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
