"""Decoding's CPU engine: the Transformer's inference, run through aiayn's kernels.

:class:`~aiayn.model.Transformer` is the paper's model in torch (§3) and nothing else. This
module runs the same model for decoding, faster on a CPU, the way CTranslate2 runs a converted
model: its own pass over the model's weights, with the work of eq. 1 and of the stacks' inputs
done by :mod:`aiayn.model.kernels`:

- :class:`CpuEngine` over a float model: each attention over each row's own keys in one
  kernel call (:func:`aiayn.model.kernels.attend`), so a row's numbers do not depend on its
  batch's padding; the embeddings and positions in one pass; beams that reorder a table of
  cache rows, not their keys (a gathering :class:`~aiayn.model.DecoderCache`).
- :class:`Int8Transformer`, built by :func:`aiayn.model.quantize.quantize_int8`: the same,
  over int8 linear maps, with W^Q, W^K and W^V of each self-attention as one map, a
  bfloat16 cache, whole stacks in fused passes (:mod:`aiayn.model.fused`) and an output
  layer whose log-softmax and greedy choice run from the product's sums in one kernel.

Both implement the protocol the searches drive (:class:`aiayn.decoding.search.CachedStep`):

- ``encode(src, src_mask=None) -> (memory, src_mask)``
- ``start_cache(memory, src_mask, capacity=0) -> DecoderCache``
- ``decode_step(tokens, cache) -> logits`` (B, t_new, V), as the model's own
- ``decoder_output(tokens, cache) -> x`` (B, t_new, d_model): the output layer's input
- ``output_layer(token_ids=None) -> OutputLayer``: the pre-softmax map onto every token or
  onto ``token_ids``, with its log-softmax and greedy choice
- ``compact_token_ids``: the columns decoding scores by default (None: every token)

Where a kernel cannot run (a GPU, gradients on, attention being recorded, autocast, numba
absent or ``AIAYN_NO_KERNELS=1``) each operation falls back to the torch operation the model
itself runs, so an engine decodes anywhere; :func:`as_engine` gives any model one.

Shape legend as in :mod:`aiayn.model.transformer`: B batch, S source length, t positions
decoded, d d_model, h heads, V vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model import kernels
from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import (
    DecoderLayer,
    EncoderLayer,
    MultiHeadAttention,
    Transformer,
    _check_src_mask,
    band_mask,
)


class OutputLayer:
    """The pre-softmax linear map of decoding (§3.4) over some columns: (n, d_model) ->
    (n, k), column j scoring token ``token_ids[j]`` (every token, in order, where
    ``token_ids`` is None).

    Args:
        weight: (k, d_model) rows of the tied output matrix; bias: (k,) or None.
        token_ids: long (k,), each column's token, or None.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, token_ids: Tensor | None) -> None:
        self.weight, self.bias, self.token_ids = weight, bias, token_ids

    def logits(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> logits (..., k)."""
        return F.linear(x, self.weight, self.bias)

    def log_probs(self, x: Tensor) -> Tensor:
        """float32 (..., k): the log-softmax of :meth:`logits`
        (:func:`aiayn.model.kernels.log_softmax`, decoding's one log-softmax)."""
        return kernels.log_softmax(self.logits(x))

    def greedy(self, x: Tensor, eos: int, eos_banned, eos_only) -> tuple[Tensor, Tensor] | None:
        """Greedy search's choice for x (n, d_model) under its length rules without writing
        the log-probabilities (see :func:`aiayn.model.kernels.rescale_greedy`): (column long
        (n,), log-probability float32 (n,)), or None where no such kernel runs (here: never;
        the caller then chooses from :meth:`log_probs`)."""
        return None


class Int8OutputLayer(OutputLayer):
    """:class:`OutputLayer` over an int8 map (:class:`aiayn.model.quantize.Int8Linear`):
    its log-softmax and greedy choice are computed from the product's sums in one kernel,
    the logits never written out (the same numbers as from the logits)."""

    def __init__(self, linear: nn.Module, token_ids: Tensor | None) -> None:
        self.linear, self.token_ids = linear, token_ids

    def logits(self, x: Tensor) -> Tensor:
        return self.linear(x)

    def log_probs(self, x: Tensor) -> Tensor:
        return self.linear.log_softmax(x)

    def greedy(self, x: Tensor, eos: int, eos_banned, eos_only) -> tuple[Tensor, Tensor] | None:
        return self.linear.greedy(x, eos, eos_banned, eos_only)


class CpuEngine(nn.Module):
    """A Transformer's decoding on the CPU kernels (see the module docstring).

    The engine holds the model (``model``, a submodule: ``.to``, ``.eval`` and
    ``.parameters`` reach it) and reads its weights; it changes nothing in it. Cheap to make
    (:func:`as_engine` makes one per batch).

    Args:
        model: the :class:`~aiayn.model.Transformer` to run.
        qkv: per stack (encoder layers, decoder layers), one map per layer for its
            self-attention's W^Q, W^K and W^V together, their outputs side by side
            (x -> (…, h d_k + h d_k + h d_v)); None: the layers' own three maps.
        cache_dtype: the dtype the decoder cache keeps keys and values in where the kernels
            read them (bfloat16 halves what a step reads); None: the keys' own.
    """

    def __init__(self, model: Transformer, *,
                 qkv: tuple[list[nn.Module], list[nn.Module]] | None = None,
                 cache_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        N = len(model.encoder)
        self.encoder_qkv = nn.ModuleList(qkv[0]) if qkv is not None else [None] * N
        self.decoder_qkv = nn.ModuleList(qkv[1]) if qkv is not None else [None] * N
        self.cache_dtype = cache_dtype
        self.training = model.training  # the model's mode (.train() walks the model: not here)

    # --- the protocol ---------------------------------------------------------------------

    @property
    def compact_token_ids(self) -> Tensor | None:
        """The columns decoding scores unless told otherwise: None, every token."""
        return None

    def output_layer(self, token_ids: Tensor | None = None) -> OutputLayer:
        """The pre-softmax map (tied to the target embedding, §3.4) onto every token, or onto
        ``token_ids`` (long (k,)) only: the logits the model gives those tokens."""
        m = self.model
        weight, bias = m.tgt_embed.weight, m.final_logits_bias
        if token_ids is not None:
            weight = weight[token_ids]
            bias = None if bias is None else bias[token_ids]
        return OutputLayer(weight, bias, token_ids)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`Transformer.encode`: src (B, S) ids, src_mask bool (B, S) or None ->
        memory (B, S, d_model) and the source mask."""
        m = self.model
        if src_mask is None:
            src_mask = src != m.config.pad_id
        _check_src_mask(src_mask, src.shape)
        attn_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        window = m.config.attention_window
        if window is not None:  # §4: a band of width 2r + 1, and each position sees itself
            S = src.shape[1]
            band = band_mask(S, S, window, causal=False, device=src.device)
            attn_mask = attn_mask & band | torch.eye(S, dtype=torch.bool, device=src.device)
        x = self._embed(m.src_embed, src, 0, m.config.word_dropout)
        key_len = None
        if window is None and not m.training and kernels.usable(x):
            key_len = kernels.prefix_lengths(src_mask)  # None unless right-padded
        if key_len is not None:
            memory = self._fused_encode(x, key_len)
            if memory is not None:  # the real positions' numbers, in fewer operations
                return memory, src_mask
        for layer, qkv in zip(m.encoder, self.encoder_qkv):
            x = _encoder_layer(layer, qkv, x, attn_mask, key_len)
        if m.encoder_norm is not None:
            x = m.encoder_norm(x)
        return x, src_mask

    def start_cache(self, memory: Tensor, src_mask: Tensor, capacity: int = 0) -> DecoderCache:
        """:meth:`Transformer.start_cache`; on the CPU kernels a gathering cache (beams
        reorder a table of rows, not their keys) in :attr:`cache_dtype`, whose encoder keys
        and values are contiguous per (sentence, head), the layout the kernels stream best."""
        m = self.model
        cross = [layer.cross_attn.project_kv(memory) for layer in m.decoder]
        window = m.config.attention_window
        gather = window is None and not m.training and kernels.usable(memory)
        kv_dtype = self.cache_dtype if gather else None
        if kv_dtype is not None:
            cross = [(k.to(kv_dtype, memory_format=torch.contiguous_format),
                      v.to(kv_dtype, memory_format=torch.contiguous_format)) for k, v in cross]
        return DecoderCache.start(cross, src_mask, window=window, capacity=capacity,
                                  gather=gather, kv_dtype=kv_dtype)

    def decoder_output(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """The decoder stack for ``tokens`` (B, t_new), extending ``cache`` by t_new
        positions: (B, t_new, d_model), the input of the pre-softmax map (a pre-norm
        stack's final LayerNorm applied)."""
        m = self.model
        x = self._embed(m.tgt_embed, tokens, cache.length)
        cross_len = None
        if not m.training and kernels.usable(x):
            cross_len = cache.source_lengths()  # None unless right-padded
        fused = self._fused_step(x, cache, cross_len)
        if fused is not None:  # the same numbers in fewer Python-level operations
            x = fused
        else:
            cross_mask = cache.src_mask[:, None, None, :]
            for i, (layer, qkv) in enumerate(zip(m.decoder, self.decoder_qkv)):
                x = _decoder_layer(layer, qkv, x, cache.cross[i], cross_mask, cache, i,
                                   cross_len)
        cache.advance(tokens.shape[1])
        return x if m.decoder_norm is None else m.decoder_norm(x)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """:meth:`Transformer.decode_step`: logits (B, t_new, V_tgt) for the positions after
        ``tokens`` (B, t_new), extending ``cache``."""
        return self.output_layer().logits(self.decoder_output(tokens, cache))

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V_tgt) for a whole shifted-right target ``tgt_in``
        (B, T): the model's own :meth:`Transformer.decode` (an uncached search,
        :class:`aiayn.decoding.search.UncachedStep`)."""
        return self.model.decode(tgt_in, memory, src_mask)

    # --- what an int8 engine does in fused passes (none here) -----------------------------

    def _fused_encode(self, x: Tensor, key_len: Tensor) -> Tensor | None:
        return None

    def _fused_step(self, x: Tensor, cache: DecoderCache,
                    cross_len: Tensor | None) -> Tensor | None:
        return None

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int,
               word_dropout: float = 0.0) -> Tensor:
        """§3.4-3.5's input of a stack, in one kernel pass where it runs (the same numbers)."""
        m = self.model
        if not m.training and kernels.usable(embedding.weight, kind="embed"):
            x = kernels.embed(embedding.weight, tokens, m.embed_scale,
                              m.positions(tokens.shape[1], offset))
            if x is not None:  # (dropout is off outside training)
                return x
        return m._embed(embedding, tokens, offset, word_dropout)


class Int8Transformer(CpuEngine):
    """An int8 inference copy of a Transformer (:func:`aiayn.model.quantize.quantize_int8`
    builds it; see :mod:`aiayn.model.quantize`), decoded as :class:`CpuEngine` decodes.

    Args:
        model: the copy, its linear maps int8 and its LayerNorms the kernels' (its
            self-attentions' W^Q, W^K, W^V may be gone, in ``qkv``).
        qkv, cache_dtype: as :class:`CpuEngine`'s.
        output: the int8 pre-softmax map onto every token (the tied target embedding, with
            ``final_logits_bias``); (…, d_model) -> (…, V_tgt).
        compact: (map, token ids long (V',)): decoding's own map onto the only tokens the
            model can produce (:meth:`~aiayn.model.Transformer.output_token_ids`), or None.
        fused_step, fused_encoder: the stacks as fused passes
            (:class:`~aiayn.model.fused.FusedInt8Step`,
            :class:`~aiayn.model.fused.FusedInt8Encoder`), or None: layer by layer.
    """

    def __init__(self, model: Transformer, *, qkv, cache_dtype, output: nn.Module,
                 compact: tuple[nn.Module, Tensor] | None = None, fused_step=None,
                 fused_encoder=None) -> None:
        super().__init__(model, qkv=qkv, cache_dtype=cache_dtype)
        self.output_projection = output
        self.step_projection = None if compact is None else compact[0]
        self._compact_ids = None if compact is None else compact[1]
        self.fused_step = fused_step
        self.fused_encoder = fused_encoder

    @property
    def compact_token_ids(self) -> Tensor | None:
        """long (V',), the tokens the output layer can produce, which decoding scores by
        default (ids 0-2, PAD, BOS and EOS, always among them); None: every token."""
        return self._compact_ids

    def output_layer(self, token_ids: Tensor | None = None) -> OutputLayer:
        """The int8 pre-softmax map onto every token or onto ``token_ids`` (long (k,)): each
        column's logit the full map's bit for bit (the rows keep their scales)."""
        if token_ids is None:
            return Int8OutputLayer(self.output_projection, None)
        if token_ids is self._compact_ids:
            return Int8OutputLayer(self.step_projection, token_ids)
        return Int8OutputLayer(self.output_projection.rows(token_ids), token_ids)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V_tgt) for ``tgt_in`` (B, T): its T positions as one
        step over a fresh cache (the copy's layers have no uncached pass of their own)."""
        cache = self.start_cache(memory, src_mask, capacity=tgt_in.shape[1])
        return self.decode_step(tgt_in, cache)

    def _fused_encode(self, x: Tensor, key_len: Tensor) -> Tensor | None:
        return None if self.fused_encoder is None else self.fused_encoder.run(x, key_len)

    def _fused_step(self, x: Tensor, cache: DecoderCache,
                    cross_len: Tensor | None) -> Tensor | None:
        return None if self.fused_step is None else self.fused_step.run(x, cache, cross_len)


def as_engine(model: nn.Module) -> CpuEngine:
    """``model`` itself when it is an engine (an :class:`Int8Transformer`, a
    :class:`CpuEngine`), else a :class:`CpuEngine` over it (a
    :class:`~aiayn.model.Transformer`): what decoding runs."""
    return model if isinstance(model, CpuEngine) else CpuEngine(model)


# --- the layers' inference passes --------------------------------------------------------


def _project_qkv(attn: MultiHeadAttention, qkv: nn.Module | None, y: Tensor
                 ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """:meth:`MultiHeadAttention.project_qkv`, from one map for the three where given."""
    if qkv is None:
        return attn.project_qkv(y)
    out = qkv(y)
    a, b = attn.h * attn.d_k, 2 * attn.h * attn.d_k
    return out[..., :a], (attn._split(out[..., a:b], attn.d_k),
                          attn._split(out[..., b:], attn.d_v))


def _attention(attn: MultiHeadAttention, y: Tensor, kv: tuple[Tensor, Tensor],
               mask: Tensor | None, *, group: int = 1, projected: Tensor | None = None,
               key_len: Tensor | None = None, causal_from: int = -1,
               key_rows: Tensor | None = None) -> Tensor:
    """:meth:`MultiHeadAttention.forward` for inference, (B, Tq, d_model).

    With ``key_len`` (long (B / group,), the keys each row of ``kv`` holds, a prefix: what
    ``mask`` allows, the caller vouches) the attention runs in
    :func:`aiayn.model.kernels.attend` where it can, over each row's own keys only;
    ``causal_from`` (-1, or the position of the first query among the keys) then says which
    keys each query may see, and ``key_rows`` (long (B, Tk)) where each row's keys lie in a
    gathering cache's buffers. Elsewhere the module's own torch path runs, over the rows'
    keys gathered and widened to the queries' dtype.
    """
    q_flat = attn.W_q(y) if projected is None else projected  # (B, Tq, h * d_k)
    k, v = kv
    if (key_len is not None and not attn.record_weights and not attn.training
            and kernels.usable(q_flat) and kernels.kv_usable(k, v)):
        B, Tq = q_flat.shape[:2]
        out = kernels.attend(q_flat.reshape(B, Tq, attn.h, attn.d_k), k, v, key_len,
                             group=group, causal_from=causal_from,
                             key_rows=key_rows)  # (B, Tq, h, d_v)
        return attn.W_o(out.view(B, Tq, attn.h * attn.d_v))
    if k.dtype != q_flat.dtype:  # a bf16 cache read outside the kernel: widened, exactly
        k, v = k.to(q_flat.dtype), v.to(q_flat.dtype)
    if key_rows is not None:  # the rows' own keys, gathered from where they lie
        pos = torch.arange(key_rows.shape[1], device=key_rows.device)[None, :]
        k = k.transpose(1, 2)[key_rows, pos].transpose(1, 2)
        v = v.transpose(1, 2)[key_rows, pos].transpose(1, 2)
    return attn(y, (k, v), mask, group=group, projected=q_flat)


def _encoder_layer(layer: EncoderLayer, qkv: nn.Module | None, x: Tensor,
                   attn_mask: Tensor, key_len: Tensor | None) -> Tensor:
    """:meth:`EncoderLayer.forward` (x (B, S, d_model)), attending through the kernel when
    ``key_len`` (long (B,)) gives each row's real tokens."""
    y = layer.res_attn.inner(x)
    q, kv = _project_qkv(layer.self_attn, qkv, y)
    x = layer.res_attn.outer(x, _attention(layer.self_attn, y, kv, attn_mask, projected=q,
                                           key_len=key_len))
    return layer.res_ffn.outer(x, layer.ffn(layer.res_ffn.inner(x)))


def _decoder_layer(layer: DecoderLayer, qkv: nn.Module | None, x: Tensor,
                   cross_kv: tuple[Tensor, Tensor], cross_mask: Tensor, cache: DecoderCache,
                   i: int, cross_len: Tensor | None) -> Tensor:
    """:meth:`DecoderLayer.forward` with a cache, for layer ``i``: x (n, t_new, d_model).
    ``cross_len``: long (n / group,), each sentence's real source tokens (a prefix), or None;
    given, both attentions run through the kernel where they can."""
    y = layer.res_self.inner(x)
    q, kv = _project_qkv(layer.self_attn, qkv, y)
    k_offset = cache.length - cache.cached_len(i)  # first position still cached
    kv = cache.append_self(i, *kv)
    mask = None
    t_new, t_all = x.shape[1], kv[0].shape[2]
    window = layer.window
    if t_new > 1 or (window is not None and t_all > window + 1):
        mask = band_mask(t_new, t_all, window, causal=True, q_offset=cache.length,
                         k_offset=k_offset, device=x.device)
    self_len = None
    if cross_len is not None and window is None:  # every row holds all t_all
        self_len = cache.self_lengths(x.shape[0], t_all)
    attn = _attention(layer.self_attn, y, kv, mask, projected=q, key_len=self_len,
                      causal_from=cache.length if t_new > 1 else -1, key_rows=cache.key_rows)
    x = layer.res_self.outer(x, attn)
    y = layer.res_cross.inner(x)
    x = layer.res_cross.outer(x, _attention(layer.cross_attn, y, cross_kv, cross_mask,
                                            group=cache.group, key_len=cross_len))
    return layer.res_ffn.outer(x, layer.ffn(layer.res_ffn.inner(x)))


__all__ = ["CpuEngine", "Int8OutputLayer", "Int8Transformer", "OutputLayer", "as_engine"]
