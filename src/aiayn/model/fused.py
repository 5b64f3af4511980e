"""One int8 decoding step through the decoder stack, and the int8 encoder over a batch's real
tokens, each with the fewest Python-level operations.

After round 4's kernels, an int8 decoding step on the CPU spent more time returning to Python
between its maps than in them: each :class:`~aiayn.model.quantize.Int8Linear` call, each
attention call, each residual and each reshape is a handful of Python-level operations, and a
step's working set evicts the interpreter's data, so each costs 2-3x what it costs in a loop
(``docs/benchmarks.md``). :class:`FusedInt8Step` runs the same step as
:meth:`aiayn.model.engine.CpuEngine.decoder_output`'s layer loop, in per sub-layer calls only:

- self-attention: quantize its input; the W^QKV product; one kernel that rescales the sums,
  writes the new keys and values into the cache's buffers, attends and quantizes the output
  (:func:`aiayn.model.kernels._self_attention_step`); the W^O product; one kernel for the
  rescaling, the residual and (post-norm) the LayerNorm (§3.1; the "norm" kernel, as the module
  path's :class:`~aiayn.model.quantize.KernelLayerNorm` runs it);
- encoder-decoder attention: the same, the queries' rescaling, attention and quantization in
  one kernel;
- FFN: quantize, the W_1 product, one kernel for rescaling, relu and quantization, the W_2
  product, rescaling with the residual, LayerNorm.

Every number is the module path's, bit for bit: the same kernels in the same order, the same
LayerNorm and products, and float additions that round alike
(``tests/unit/test_int8_decoding.py`` compares the logits of every step). It runs where the
module path would run the CPU kernels: float32 on the CPU, no gradients, a gathering
:class:`~aiayn.model.DecoderCache`, right-padded sources, one new position per row, no
attention being recorded. Anywhere else :meth:`FusedInt8Step.run` returns None before it
touches the cache, and the module path runs.

:class:`FusedInt8Encoder` runs the encoder stack the same way, over the real tokens of a
right-padded batch packed into one block, so no map runs over padding: 23% less time to encode
a ``base`` batch of 32 sentences, 4% for ``multi30k`` (``docs/benchmarks.md``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aiayn.model import kernels
from aiayn.model.cache import DecoderCache


class _Layer:
    """One layer's modules as plain attributes, looked up once: each lookup of a submodule
    through ``nn.Module.__getattr__`` costs a Python call, and the dozen a layer makes each
    step took about 3% of a ``multi30k`` greedy decode. The sub-layers' norms are their
    residual wrappers' (``res_*.norm``)."""

    __slots__ = ("self_attn", "W_qkv", "W_o", "self_norm", "cross_attn", "W_q", "cross_W_o",
                 "cross_norm", "W_1", "W_2", "ffn_norm")

    def __init__(self, layer, qkv) -> None:
        self.self_attn = layer.self_attn
        self.W_qkv, self.W_o = qkv, self.self_attn.W_o
        res = layer.res_self if hasattr(layer, "res_self") else layer.res_attn
        self.self_norm = res.norm
        self.cross_attn = getattr(layer, "cross_attn", None)  # decoder layers only
        if self.cross_attn is not None:
            self.W_q, self.cross_W_o = self.cross_attn.W_q, self.cross_attn.W_o
            self.cross_norm = layer.res_cross.norm
        self.W_1, self.W_2 = layer.ffn.W_1, layer.ffn.W_2
        self.ffn_norm = layer.res_ffn.norm


class _FusedStack:
    """What the fused passes over a stack need of the model: its layers (each with its
    self-attention's one int8 map for W^Q, W^K and W^V, ``qkv``), the attention's shape
    (h, d_k, d_v, d_model), the norm's place and eq. 1's scale 1 / sqrt(d_k)."""

    def __init__(self, model, stack, qkv) -> None:
        cfg = model.config
        self.layers = [_Layer(layer, w) for layer, w in zip(stack, qkv)]
        self.h, self.d_k, self.d_v, self.d_model = cfg.h, cfg.d_k, cfg.d_v, cfg.d_model
        self.pre_norm = cfg.norm == "pre"
        self.scale = np.float32(cfg.d_k**-0.5)  # kernels.attend's default scale


class FusedInt8Step(_FusedStack):
    """The decoder stack of an int8 copy (:func:`aiayn.model.quantize.quantize_int8`) as one
    step function: x (n, 1, d_model) -> (n, 1, d_model), the input of the output layer.

    Args:
        model: the int8 copy's :class:`~aiayn.model.Transformer`: int8 maps, each FFN's relu
            inside ``W_1`` (the caller, ``quantize_int8``, checks).
        qkv: per decoder layer, its self-attention's int8 map for W^Q, W^K and W^V.
    """

    def __init__(self, model, qkv) -> None:
        _FusedStack.__init__(self, model, model.decoder, qkv)
        self.steps = 0  # steps run here (the module path ran the others)

    def run(self, x: Tensor, cache: DecoderCache, cross_len: Tensor | None) -> Tensor | None:
        """The decoder layers for one new position per row, extending ``cache``.

        Args:
            x: float32 (n, 1, d_model), the embedded newest tokens (positions added).
            cache: the step's cache; extended by one position here (the caller then calls
                :meth:`~aiayn.model.DecoderCache.advance`, as after the module path).
            cross_len: long (B',), each sentence's real source tokens
                (:meth:`~aiayn.model.DecoderCache.source_lengths`), or None.

        Returns:
            float32 (n, 1, d_model), or None (cache untouched) where this path does not apply.
        """
        n, t_new, d = x.shape
        if (t_new != 1 or cross_len is None or not cache.gather or cache.window is not None
                or not kernels.usable(x, kind="int8") or not kernels.usable(x)):
            return None
        for layer in self.layers:
            if layer.self_attn.record_weights or layer.cross_attn.record_weights:
                return None
        H, Dk, Dv, scale, pre = self.h, self.d_k, self.d_v, self.scale, self.pre_norm
        pos, table = cache.begin_step(n, H, Dk, Dv, x)
        scratch = cache.scratch
        rows = _numpy_of(scratch, "rows", table)
        key_len = _numpy_of(scratch, "cross_len", cross_len)
        group = cache.group
        quantize = kernels._quantize_rows
        xs = x.reshape(n, d).contiguous().numpy()
        for i, layer in enumerate(self.layers):
            # masked self-attention (§3.2.3) over the cache, then the residual (§5.4)
            norm = layer.self_norm
            x8, sx = quantize(_layer_norm(norm, xs) if pre else xs, 127)
            lin = layer.W_qkv
            kb, vb = _buffers(scratch, cache, i)
            a8, sa = kernels._self_attention_step(
                lin._product(torch.from_numpy(x8)).numpy(), sx, *lin._arrays(), H, Dk, Dv,
                kb, vb, pos, rows, scale, 127)
            xs = _output(layer.W_o, a8, sa, xs, None if pre else norm)
            # encoder-decoder attention over this layer's cached encoder keys and values
            norm = layer.cross_norm
            x8, sx = quantize(_layer_norm(norm, xs) if pre else xs, 127)
            lin = layer.W_q
            k, v, kv_at = _cross(scratch, cache, i)
            a8, sa = kernels._cross_attention_step(
                lin._product(torch.from_numpy(x8)).numpy(), sx, *lin._arrays(), H, Dk, Dv,
                k, v, kv_at, key_len, group, scale, kernels._NO_ROWS, 127)
            xs = _output(layer.cross_W_o, a8, sa, xs, None if pre else norm)
            xs = _ffn(layer, xs, pre)
        self.steps += 1
        return torch.from_numpy(xs).view(n, 1, d)


class FusedInt8Encoder(_FusedStack):
    """The encoder stack of an int8 copy (:func:`aiayn.model.quantize.quantize_int8`) over the
    batch's real tokens only: x (B, S, d_model) embedded -> memory (B, S, d_model).

    The real tokens of a right-padded batch are packed into one (n, d_model) block, so no map
    runs over padding, and each sub-layer is the few calls of :class:`FusedInt8Step`: quantize,
    the product, one kernel for rescaling and attention over each token's own sentence
    (:func:`aiayn.model.kernels._encoder_attention`), the W^O product with the residual in one
    kernel with the LayerNorm (§3.1); the FFN as in the decoder step. Every real
    position's numbers are the module path's bit for bit (each token's attention runs over its
    own sentence in the same kernel, and every other pass is per row); padding positions of
    the memory are zeros, which no reader sees (the attention kernels stop at each sentence's
    length). Where it does not apply (see :meth:`run`) the module path runs.

    Args:
        model: the int8 copy's :class:`~aiayn.model.Transformer`, as for
            :class:`FusedInt8Step`.
        qkv: per encoder layer, its self-attention's int8 map for W^Q, W^K and W^V.
    """

    def __init__(self, model, qkv) -> None:
        _FusedStack.__init__(self, model, model.encoder, qkv)
        self.final_norm = model.encoder_norm
        self.calls = 0  # batches encoded here (the module path encoded the others)

    def run(self, x: Tensor, key_len: Tensor) -> Tensor | None:
        """The encoder layers over a right-padded batch.

        Args:
            x: float32 (B, S, d_model), the embedded sources (positions added).
            key_len: long (B,), each sentence's real tokens, a prefix of its row
                (:func:`aiayn.model.kernels.prefix_lengths`).

        Returns:
            float32 (B, S, d_model), zeros at padding; or None where this path does not apply
            (the kernels cannot run on x, or attention is being recorded).
        """
        if not kernels.usable(x, kind="int8") or not kernels.usable(x):
            return None
        for layer in self.layers:
            if layer.self_attn.record_weights:
                return None
        B, S, d = x.shape
        lengths = key_len.numpy()
        starts = np.zeros(B, np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        # row r of the block is token r - starts[b] of sentence b; its keys are rows
        # starts[b] .. starts[b] + lengths[b] - 1
        sentence = np.repeat(np.arange(B), lengths)
        first = starts[sentence]
        key_rows = first[:, None] + np.arange(max(S, 1))[None, :]
        row_len = lengths[sentence]
        real = (torch.arange(S)[None, :] < key_len[:, None]).reshape(-1)
        xs = x.reshape(B * S, d)[real].numpy()  # (n, d), a fresh copy
        H, Dk, Dv, scale, pre = self.h, self.d_k, self.d_v, self.scale, self.pre_norm
        quantize = kernels._quantize_rows
        for layer in self.layers:
            norm = layer.self_norm
            x8, sx = quantize(_layer_norm(norm, xs) if pre else xs, 127)
            lin = layer.W_qkv
            a8, sa = kernels._encoder_attention(
                lin._product(torch.from_numpy(x8)).numpy(), sx, *lin._arrays(), H, Dk, Dv,
                key_rows, row_len, scale, 127)
            xs = _output(layer.W_o, a8, sa, xs, None if pre else norm)
            xs = _ffn(layer, xs, pre)
        if self.final_norm is not None:
            xs = _layer_norm(self.final_norm, xs)
        memory = x.new_zeros(B * S, d)
        memory[real] = torch.from_numpy(xs)
        self.calls += 1
        return memory.view(B, S, d)


def _ffn(layer: _Layer, xs: np.ndarray, pre: bool) -> np.ndarray:
    """A layer's FFN sub-layer (§3.3) over float32 (n, d_model) rows with its residual and
    LayerNorm: quantize, the W_1 product, one kernel for rescaling, relu (inside W_1's
    rescaling) and quantizing, the W_2 product, rescaling with the residual (and the
    LayerNorm, post-norm)."""
    norm = layer.ffn_norm
    x8, sx = kernels._quantize_rows(_layer_norm(norm, xs) if pre else xs, 127)
    lin = layer.W_1
    h8, sh = kernels._rescale_quantize(lin._product(torch.from_numpy(x8)).numpy(), sx,
                                       *lin._arrays(), lin.relu, 127)
    return _output(layer.W_2, h8, sh, xs, None if pre else norm)


def _output(lin, x8: np.ndarray, x_scale: np.ndarray, resid: np.ndarray,
            norm=None) -> np.ndarray:
    """``resid + lin(x)`` from the int8 rows of x: a sub-layer's output map and its residual;
    with ``norm`` (post-norm, §3.1), LayerNorm of that, in the same kernel where the "norm"
    kernels run."""
    acc = lin._product(torch.from_numpy(x8)).numpy()
    if norm is not None and _kernel_norm(norm):
        return kernels._rescale_add_norm(acc, x_scale, *lin._arrays(), resid, *norm.arrays())
    y = kernels._rescale_add(acc, x_scale, *lin._arrays(), resid)
    return y if norm is None else _layer_norm(norm, y)


def _kernel_norm(norm) -> bool:
    """Whether ``norm`` runs in the "norm" kernel (a :class:`~aiayn.model.quantize.
    KernelLayerNorm`, as the module path would run it), not torch's."""
    return "norm" in kernels.ENABLED and hasattr(norm, "arrays")


def _layer_norm(norm, x: np.ndarray) -> np.ndarray:
    """``norm(x)`` over float32 (n, d) rows, as the module path computes it."""
    if _kernel_norm(norm):
        return kernels._layer_norm(x, *norm.arrays())
    return norm(torch.from_numpy(x)).numpy()


def _numpy_of(scratch: dict, name: str, t: Tensor) -> np.ndarray:
    """``t.numpy()``, made once per tensor (kept in the cache's ``scratch``)."""
    known = scratch.get(name)
    if known is None or known[0] is not t:
        known = scratch[name] = (t, t.numpy())
    return known[1]


def _buffers(scratch: dict, cache: DecoderCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``layer``'s self-attention buffers as numpy arrays, remade when they are."""
    k, v = cache.buffers(layer)
    known = scratch.get(("self", layer))
    if known is None or known[0] is not k or known[1] is not v:
        known = scratch[("self", layer)] = (k, v, kernels.as_array(k), kernels.as_array(v))
    return known[2], known[3]


def _cross(scratch: dict, cache: DecoderCache, layer: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer ``layer``'s encoder keys and values as flat storages, with their offsets and
    strides (``at[4:]`` of :func:`aiayn.model.kernels._attend`), remade when they are."""
    k, v = cache.cross[layer]
    known = scratch.get(("cross", layer))
    if known is None or known[0] is not k or known[1] is not v:
        # each (sentence, head)'s keys contiguous, once per batch (a bf16 cache's already
        # are: start_cache): read every step, a split projection's strided keys (h * d_k
        # apart) streamed worse from memory
        kc, vc = k.contiguous(), v.contiguous()
        at = np.array([kc.storage_offset(), *kc.stride()[:3], kc.shape[2],
                       vc.storage_offset(), *vc.stride()[:3]], dtype=np.int64)
        known = scratch[("cross", layer)] = (k, v, kernels._storage(kc), kernels._storage(vc),
                                             at, kc, vc)
    return known[2], known[3], known[4]


__all__ = ["FusedInt8Encoder", "FusedInt8Step"]
