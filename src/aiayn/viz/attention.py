"""The attention weights of one translation, taken from the model's own forward pass.

:func:`record_attention` switches every :class:`~aiayn.model.transformer.MultiHeadAttention` of
a model to its recording path for the duration of a ``with`` block; the weights it keeps are
the softmax(Q K^T / sqrt(d_k)) (eq. 1, §3.2.1) that produced the layer's output, masks applied.
:func:`attention_maps` runs one teacher-forced pass over a (source, target) pair, where the
target is given or is the model's own beam-search output, and returns every layer and head.

Three kinds of attention (§3.2.3):

* ``encoder``: encoder self-attention, queries and keys are source tokens, (N, h, S, S);
* ``decoder``: masked decoder self-attention over the decoder inputs, (N, h, T, T), zero above
  the diagonal;
* ``cross``: encoder-decoder attention, decoder queries over source keys, (N, h, T, S).

Decoder row ``i`` is the position whose input is ``target_inputs[i]`` (``<s>`` first) and that
predicts ``target_outputs[i]`` (``</s>`` last).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.data.vocab import BOS, EOS, EOS_ID, Vocabulary
from aiayn.model.recording import KINDS, AttentionRecord, record_attention  # noqa: F401


@dataclass(frozen=True)
class AttentionMaps:
    """Every attention weight of one (source, target) pair.

    Attributes:
        source_tokens: S subword strings of the encoder input, ``</s>`` last.
        target_inputs: T decoder inputs, ``<s>`` then the target's subwords.
        target_outputs: T tokens the positions predict, the target's subwords then ``</s>``.
        encoder: (N, h, S, S); decoder: (N, h, T, T); cross: (N, h, T, S); float32, rows sum
            to 1 over the keys (last dimension).
        target_text: the detokenized target; ``forced``: True when it was given, False when it
            is the model's own beam output; ``score``: the search score (None when forced).
    """

    source_tokens: list[str]
    target_inputs: list[str]
    target_outputs: list[str]
    encoder: Tensor
    decoder: Tensor
    cross: Tensor
    target_text: str
    forced: bool
    score: float | None = None

    def of(self, kind: str) -> Tensor:
        """The (N, h, Tq, Tk) weights of ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return getattr(self, kind)

    def labels(self, kind: str) -> tuple[list[str], list[str]]:
        """(query labels, key labels) of ``kind``: cross-attention queries are labelled by the
        token they predict, decoder self-attention by their input."""
        return {"encoder": (self.source_tokens, self.source_tokens),
                "decoder": (self.target_inputs, self.target_inputs),
                "cross": (self.target_outputs, self.source_tokens)}[kind]

    def to_json(self, kinds: tuple[str, ...] = KINDS, layer: int | None = None,
                head: int | None = None, decimals: int = 4) -> dict:
        """A JSON-ready dict: tokens, shapes and weights as nested lists ``[layer][head][q][k]``.

        ``layer`` and ``head`` (0-based) keep a single one; the shapes say what was kept.
        """
        out = {"source_tokens": self.source_tokens, "target_inputs": self.target_inputs,
               "target_outputs": self.target_outputs, "target": self.target_text,
               "forced": self.forced, "score": self.score,
               "layers": int(self.encoder.shape[0]), "heads": int(self.encoder.shape[1]),
               "attention": {}}
        for kind in kinds:
            w = self.of(kind)
            layers = range(w.shape[0]) if layer is None else [layer]
            heads = range(w.shape[1]) if head is None else [head]
            w = w[list(layers)][:, list(heads)]
            out["attention"][kind] = {
                "shape": list(w.shape), "layers": list(layers), "heads": list(heads),
                "queries": self.labels(kind)[0], "keys": self.labels(kind)[1],
                "weights": torch.round(w, decimals=decimals).tolist()}
        return out


def attention_maps(
    model,
    vocab: Vocabulary,
    source: str,
    target: str | None = None,
    *,
    out_ids: list[int] | None = None,
    score: float | None = None,
) -> AttentionMaps:
    """The attention of ``model`` reading ``source`` and writing a target, every layer and
    head, with the target forced (teacher forcing). :meth:`aiayn.Translator.attention` is the
    entry point for raw text: it preprocesses, and searches when no target is given.

    Args:
        model: a :class:`~aiayn.model.Transformer`; run in eval mode (its mode is restored).
        source: one sentence, as the model reads it.
        target: the translation to force, as the model writes it; or None with ``out_ids``.
        out_ids: the target as token ids ending in EOS (the model's own output, with its
            search ``score``).

    Raises:
        ValueError: an empty source or target, or one longer than the model's ``max_len``.
    """
    from aiayn.decoding.translate import encode_sources

    if not source.strip():
        raise ValueError("the source sentence is empty")
    max_len = model.config.max_len
    src_ids = encode_sources(vocab, [source], max_len, long_inputs="error")[0]
    if target is not None:
        if not target.strip():
            raise ValueError("the forced target sentence is empty")
        out_ids, score = vocab.encode(target) + [EOS_ID], None
        if len(out_ids) > max_len:
            raise ValueError(f"the target has {len(out_ids)} tokens with </s>, more than the "
                             f"model's max_len={max_len}")
    elif out_ids is None:
        raise ValueError("attention_maps needs a target or out_ids")
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], device=device)  # (1, S)
    start = model.config.decoder_start_id  # the model's start token (BOS; Marian: pad)
    tgt_in = torch.tensor([[start] + out_ids[:-1]], device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), record_attention(model) as rec:
            model(src, tgt_in)
    finally:
        model.train(was_training)
    stack = lambda kind: torch.stack([w[0] for w in rec.weights(kind)]).float().cpu()  # noqa: E731
    id_to_token = vocab.tokenizer.id_to_token
    source_tokens = [id_to_token(i) for i in src_ids]
    target_tokens = [id_to_token(i) for i in out_ids]
    return AttentionMaps(
        source_tokens=source_tokens,
        target_inputs=[id_to_token(start) or BOS] + target_tokens[:-1],
        target_outputs=target_tokens[:-1] + [EOS],
        encoder=stack("encoder"), decoder=stack("decoder"), cross=stack("cross"),
        target_text=vocab.decode(out_ids), forced=target is not None, score=score)
