"""A faster decoder step for greedy and beam search: the same model, other memory traffic.

:class:`FastStep` is a step function (see :mod:`aiayn.decoding.search`) over a
:class:`FastDecoder`, an inference-only copy of a Transformer's decoder weights. It differs from
:class:`~aiayn.decoding.search.CachedStep` in how it moves data, not in what it computes:

- the encoder-decoder keys and values are kept once per *sentence*, never per beam row, so a
  beam reorder never copies them; the K rows of a sentence attend to them as K queries of one
  attention call (B, h, K, d_k) x (B, h, S, d_k);
- the self-attention keys and values live in preallocated (rows, h, T_max, d_k) buffers written
  in place at step t (a reorder gathers only the t positions filled);
- the self-attention W^Q, W^K, W^V are fused into one matrix product (done here, at load time:
  checkpoints keep their separate ``W_q``, ``W_k``, ``W_v``);
- the output projection is an ``nn.Linear`` so that it is quantized with the rest;
- ``dtype="bf16"`` stores the weights of every linear map in bfloat16 and runs those products
  in bf16 (activations, caches, LayerNorm and softmax stay fp32: bf16 elementwise kernels were
  the slow part of an all-bf16 decoder here); ``dtype="int8"`` applies torch's dynamic int8
  quantization to every linear map (weights int8, activations quantized per call).

fp32 computes what :class:`CachedStep` computes up to float rounding order. The encoder runs
as usual (fp32, or bf16 autocast with ``dtype="bf16"``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DTYPES = ("fp32", "bf16", "int8")


class _BF16Linear(nn.Module):
    """A linear map with bfloat16 weights on float32 activations: the product runs in bf16
    (the CPU's avx512_bf16 kernels), everything around it stays fp32, as under autocast but
    without casting the weights at every call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


def _to_bf16_linears(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, _BF16Linear(child))
        else:
            _to_bf16_linears(child)
    return module


class _FastLayer(nn.Module):
    def __init__(self, layer, fuse: bool) -> None:
        super().__init__()
        sa, ca = layer.self_attn, layer.cross_attn
        self.h, self.d_k, self.d_v = sa.h, sa.d_k, sa.d_v
        d_model = sa.W_q.in_features
        if fuse:
            self.qkv = nn.utils.skip_init(nn.Linear, d_model,
                                          sa.W_q.out_features * 2 + sa.W_v.out_features)
            with torch.no_grad():
                self.qkv.weight.copy_(torch.cat([sa.W_q.weight, sa.W_k.weight, sa.W_v.weight]))
                self.qkv.bias.copy_(torch.cat([sa.W_q.bias, sa.W_k.bias, sa.W_v.bias]))
        else:
            self.qkv = None
            self.W_q, self.W_k, self.W_v = (copy.deepcopy(m) for m in (sa.W_q, sa.W_k, sa.W_v))
        self.W_o = copy.deepcopy(sa.W_o)
        self.cross_W_q = copy.deepcopy(ca.W_q)
        self.cross_W_k = copy.deepcopy(ca.W_k)
        self.cross_W_v = copy.deepcopy(ca.W_v)
        self.cross_W_o = copy.deepcopy(ca.W_o)
        self.W_1, self.W_2 = copy.deepcopy(layer.ffn.W_1), copy.deepcopy(layer.ffn.W_2)
        self.activation = layer.ffn.activation
        self.norm_self = copy.deepcopy(layer.res_self.norm)
        self.norm_cross = copy.deepcopy(layer.res_cross.norm)
        self.norm_ffn = copy.deepcopy(layer.res_ffn.norm)
        self.pre_norm = layer.res_self.pre_norm

    def self_qkv(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """y (n, 1, d) -> q, k (n, h, 1, d_k), v (n, h, 1, d_v)."""
        n = y.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(y).split([self.h * self.d_k] * 2 + [self.h * self.d_v], dim=-1)
        else:
            q, k, v = self.W_q(y), self.W_k(y), self.W_v(y)
        return (q.view(n, self.h, 1, self.d_k), k.view(n, self.h, 1, self.d_k),
                v.view(n, self.h, 1, self.d_v))


class FastDecoder(nn.Module):
    """Inference copy of ``model``'s decoder in ``dtype`` (see the module docstring).

    Raises:
        ValueError: unknown ``dtype``, or a model with restricted self-attention
            (``attention_window``, §4), whose band mask this decoder does not apply.
    """

    def __init__(self, model, dtype: str = "fp32") -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if model.config.attention_window is not None:
            raise ValueError(
                "fast decoding does not support restricted self-attention "
                f"(model.attention_window={model.config.attention_window}); decode without fast")
        self.model = model  # for the embeddings, positions and the encoder (not copied)
        self.config = model.config
        self.dtype_name = dtype
        self.layers = nn.ModuleList(_FastLayer(layer, fuse=dtype != "int8")
                                    for layer in model.decoder)
        V, d = model.tgt_embed.weight.shape
        self.out = nn.utils.skip_init(nn.Linear, d, V, bias=model.final_logits_bias is not None)
        with torch.no_grad():
            self.out.weight.copy_(model.tgt_embed.weight)
            if model.final_logits_bias is not None:
                # -inf (Marian's placeholder row) does not survive int8 quantization of a bias
                # the same way; a large finite value gives the same zero probability
                self.out.bias.copy_(model.final_logits_bias.clamp(min=-1e9))
        self.final_norm = copy.deepcopy(model.decoder_norm)
        self.eval()
        if dtype == "bf16":
            _to_bf16_linears(self.layers)
            self.out = _BF16Linear(self.out)
        elif dtype == "int8":
            from torch.ao.quantization import quantize_dynamic

            self.layers = quantize_dynamic(self.layers, {nn.Linear}, dtype=torch.qint8)
            self.out = quantize_dynamic(nn.Sequential(self.out), {nn.Linear},
                                        dtype=torch.qint8)[0]
        self.compute_dtype = torch.float32  # activations, caches, norms, softmax

    def start(self, memory: Tensor, src_mask: Tensor, max_steps: int) -> FastStep:
        """Step function for encoder output ``memory`` (B, S, d_model), ``src_mask`` (B, S),
        for at most ``max_steps`` decoder steps."""
        memory = memory.to(self.compute_dtype)
        B, S, _ = memory.shape
        cross = []
        for layer in self.layers:
            # keys stored transposed, (B, h, d_k, S), so no step copies them for Q K^T
            k = layer.cross_W_k(memory).view(B, S, layer.h, layer.d_k).permute(0, 2, 3, 1)
            v = layer.cross_W_v(memory).view(B, S, layer.h, layer.d_v).transpose(1, 2)
            cross.append((k.contiguous(), v.contiguous()))
        mask = src_mask[:, None, None, :]
        bias = torch.zeros(mask.shape, dtype=self.compute_dtype, device=mask.device)
        bias = bias.masked_fill(~mask, float("-inf"))
        return FastStep(self, _State(cross, mask, bias, None, None,
                                     torch.arange(B, device=memory.device), 0, max_steps))


@dataclass
class _State:
    cross: list[tuple[Tensor, Tensor]]  # per layer keys (B', h, d_k, S), values (B', h, S, d_v)
    cross_mask: Tensor  # (B', 1, 1, S) bool
    cross_bias: Tensor  # (B', 1, 1, S) 0 where cross_mask, else -inf
    self_k: list[Tensor] | None  # per layer (n, h, T_max, d_k), filled up to t
    self_v: list[Tensor] | None
    sentence: Tensor  # (n,) row -> index into the B' sentences; rows of a sentence adjacent
    t: int
    max_steps: int


def _attend(q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Eq. 1 with explicit matrix products. For one or a few queries per row these beat the
    CPU flash-attention kernel of ``F.scaled_dot_product_attention`` in fp32 (2.2 against 3.3
    ms alone for 128 rows, 8 heads, 13 keys) and, inside the decoder, in bf16 too (a profile of
    base beam-4: 2.3 ms per call against 6.2). bias: additive, 0 or -inf, broadcastable to
    (B, h, Tq, Tk); k_t: keys transposed, (B, h, d_k, Tk). Returns (B, h, Tq, d_v)."""
    scores = torch.matmul(q, k_t) * (q.shape[-1] ** -0.5)
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class FastStep:
    """Step function over a :class:`FastDecoder` (same protocol as ``CachedStep``).

    ``select(index)`` needs the rows of each sentence to stay adjacent and equally many per
    sentence, as greedy and beam search keep them.
    """

    def __init__(self, decoder: FastDecoder, state: _State) -> None:
        self.decoder = decoder
        self.state = state

    @property
    def start_id(self) -> int:
        return self.decoder.model.config.decoder_start_id

    def __call__(self, tokens: Tensor) -> Tensor:
        dec, st = self.decoder, self.state
        model = dec.model
        n = tokens.shape[0]
        if st.t >= st.max_steps + 1:
            raise ValueError(f"FastStep: more than {st.max_steps + 1} steps")
        x = model._embed(model.tgt_embed, tokens[:, None], offset=st.t).to(dec.compute_dtype)
        B_s = st.cross[0][0].shape[0]
        G = n // B_s  # rows per sentence
        if st.self_k is None:
            T = st.max_steps + 1
            st.self_k = [x.new_empty(n, L.h, T, L.d_k) for L in dec.layers]
            st.self_v = [x.new_empty(n, L.h, T, L.d_v) for L in dec.layers]
        t = st.t
        for i, L in enumerate(dec.layers):
            y = L.norm_self(x) if L.pre_norm else x
            q, k, v = L.self_qkv(y)
            st.self_k[i][:, :, t : t + 1] = k
            st.self_v[i][:, :, t : t + 1] = v
            a = _attend(q, st.self_k[i][:, :, : t + 1].transpose(-1, -2),
                        st.self_v[i][:, :, : t + 1], None)
            a = L.W_o(a.transpose(1, 2).reshape(n, 1, L.h * L.d_v))
            x = x + a if L.pre_norm else L.norm_self(x + a)
            y = L.norm_cross(x) if L.pre_norm else x
            q = L.cross_W_q(y).view(B_s, G, L.h, L.d_k).transpose(1, 2)  # (B', h, G, d_k)
            ck, cv = st.cross[i]
            a = _attend(q, ck, cv, st.cross_bias)
            a = L.cross_W_o(a.transpose(1, 2).reshape(n, 1, L.h * L.d_v))
            x = x + a if L.pre_norm else L.norm_cross(x + a)
            y = L.norm_ffn(x) if L.pre_norm else x
            f = L.W_2(L.activation(L.W_1(y)))
            x = x + f if L.pre_norm else L.norm_ffn(x + f)
        if dec.final_norm is not None:
            x = dec.final_norm(x)
        st.t += 1
        return dec.out(x[:, 0])  # (n, V)

    def select(self, index: Tensor) -> FastStep:
        st = self.state
        sentence = st.sentence.index_select(0, index)
        cross, cross_mask, cross_bias = st.cross, st.cross_mask, st.cross_bias
        B_s = cross[0][0].shape[0]
        # sentences still present (rows of a sentence are adjacent, so consecutive runs)
        first = torch.ones_like(sentence, dtype=torch.bool)
        first[1:] = sentence[1:] != sentence[:-1]
        live = sentence[first]
        if live.shape[0] != B_s:  # finished sentences leave: compact the cross K/V
            cross = [(k.index_select(0, live), v.index_select(0, live)) for k, v in cross]
            cross_mask = cross_mask.index_select(0, live)
            cross_bias = cross_bias.index_select(0, live)
            sentence = torch.cumsum(first.long(), 0) - 1
        self_k, self_v = st.self_k, st.self_v
        if self_k is not None:
            n = self_k[0].shape[0]
            if index.shape[0] == n:
                # the same rows in another order: in place, moving only the rows that change
                # (this step object must not be used afterwards; the searches never do)
                moved = (index != torch.arange(n, device=index.device)).nonzero().squeeze(1)
                if moved.numel():
                    src = index.index_select(0, moved)
                    for buf in (*self_k, *self_v):
                        flat = buf.view(n, -1)  # 2-D gathers run about twice as fast here
                        flat.index_copy_(0, moved, flat.index_select(0, src))
            else:
                self_k = [b.view(n, -1).index_select(0, index).view(-1, *b.shape[1:])
                          for b in self_k]
                self_v = [b.view(n, -1).index_select(0, index).view(-1, *b.shape[1:])
                          for b in self_v]
        return FastStep(self.decoder, _State(cross, cross_mask, cross_bias, self_k, self_v,
                                             sentence,
                                             st.t, st.max_steps))


# aiayn's faster paths, as keyword arguments of translate_nbest (bench/bench_decode_peers.py)
BENCH_PATHS = {
    "fast fp32": {"fast": "fp32"},
    "fast bf16": {"fast": "bf16", "bf16": True},  # the encoder under bf16 autocast
    "fast int8": {"fast": "int8"},
}
