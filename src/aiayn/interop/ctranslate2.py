"""Export to CTranslate2, through its own converter (``ctranslate2.converters``).

The checkpoint is first written as a Hugging Face Marian directory (:func:`export_hf`), then
``ctranslate2.converters.TransformersConverter`` turns that into a CTranslate2 model. The two
SentencePiece models are copied beside it (``source.spm``, ``target.spm``), so the directory is
all a CTranslate2 user needs::

    translator = ctranslate2.Translator(DIR)
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{DIR}/source.spm")
    pieces = sp.encode(text, out_type=str) + ["</s>"]
    out = translator.translate_batch([pieces], beam_size=4, length_penalty=0.0)

A model with aiayn's own subword vocabulary (the main job's: ``tokenizer.json``) has no Marian
form, so it is written through CTranslate2's model specification instead
(``ctranslate2.specs.TransformerSpec``, the way its docs describe for a custom converter): the
same weights, the paper's positional table and ``<s>`` start as they are, and
``tokenizer.json`` copied beside the model. EOS is added to the source by CTranslate2
(``add_source_eos``), so a user passes the pieces alone, of text preprocessed as the model's
training text was (``aiayn.Translator.preprocess``)::

    tok = tokenizers.Tokenizer.from_file(f"{DIR}/tokenizer.json")
    pieces = tok.encode(text, add_special_tokens=False).tokens
    out = translator.translate_batch([pieces], beam_size=4)

A model trained with a target-only output layer (``output_vocab = "target"``) gets a target
vocabulary of just the tokens its output bias allows (plus ``<pad>``, ``<s>``, ``</s>`` and
``<unk>``, each with a logit bias that keeps a banned one at probability 0):
the tokens it cannot produce are left out of the soft-max, as aiayn leaves them out.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from aiayn.errors import UserError
from aiayn.interop.marian import export_hf
from aiayn.rundir import TOKENIZER  # the same file name as a run's


def export_ctranslate2(model, config, vocab, directory: str | Path,
                       quantization: str | None = None, vmap: str | Path | None = None) -> Path:
    """Write a CTranslate2 model directory computing the same function as ``model``.

    CTranslate2's Marian loader starts the decoder from a zero vector and drops a trailing
    ``<pad>`` from the vocabulary, so the pad embedding must be zero and pad the last id (as in
    every OPUS-MT model).

    Args:
        quantization: CTranslate2's weight type (None: as stored, fp32; "int8", "int8_float32",
            "bfloat16", …).
        vmap: a vocabulary shortlist file (``aiayn shortlist``: CTranslate2's vmap format),
            copied into the model for its ``use_vmap=True``; read here first, so that a file
            of another vocabulary is refused.

    A checkpoint with SentencePiece vocabularies (one converted from Marian) goes through
    CTranslate2's Marian converter; any other through :func:`_export_spec`.

    Raises:
        UserError: ``ctranslate2`` not installed, or a model CTranslate2 would not reproduce
            (the message names the setting).
    """
    try:
        import ctranslate2.converters
    except ImportError:
        raise UserError("export to CTranslate2 needs the ctranslate2 package "
                        "(pip install 'aiayn[interop]')") from None
    from aiayn.data.sentencepiece_vocab import SentencePieceVocabulary

    if vmap is not None:
        from aiayn.decoding.shortlist import Shortlist

        Shortlist.load(vmap, vocab)  # its tokens are this vocabulary's (DataError otherwise)
        vmap = str(vmap)
    if not isinstance(vocab, SentencePieceVocabulary):
        return _export_spec(model, config, vocab, Path(directory), quantization, vmap)
    ids = getattr(vocab, "marian_ids", {}) or {}
    if ids and ids.get("pad") != len(vocab) - 2:  # -1 for <s>, -1 for the last index
        raise UserError(f"CTranslate2's Marian loader needs <pad> as the last token; this "
                        f"vocabulary has it at Marian id {ids.get('pad')}")
    emb = model.tgt_embed.weight
    if bool(emb[model.config.decoder_start_id].ne(0).any()):
        raise UserError("CTranslate2 starts a Marian decoder from a zero vector, but this "
                        "model's decoder start embedding is not zero")
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="aiayn-ct2-") as tmp:
        hf_dir = export_hf(model, config, vocab, Path(tmp) / "hf")
        converter = ctranslate2.converters.TransformersConverter(str(hf_dir))
        with torch.inference_mode(False):
            converter.convert(str(directory), quantization=quantization, force=True,
                              vmap=vmap)
        for name in ("source.spm", "target.spm"):
            shutil.copyfile(hf_dir / name, directory / name)
        if (hf_dir / "target_vocab.json").is_file():
            # CTranslate2's Marian loader writes the source vocabulary for both sides; write
            # the two vocabularies (Marian order, the trailing <pad> dropped as it does)
            for ours, theirs in (("vocab.json", "source"), ("target_vocab.json", "target")):
                ids = json.loads((hf_dir / ours).read_text(encoding="utf-8"))
                pieces = sorted(ids, key=ids.get)
                if pieces[-1] == "<pad>":
                    pieces.pop()
                (directory / f"{theirs}_vocabulary.json").write_text(
                    json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
            (directory / "shared_vocabulary.json").unlink(missing_ok=True)
    return directory


#: The logit bias written for a token the model's output layer never produces (its own bias is
#: -inf): finite in every compute type CTranslate2 offers (fp16 included), and exp() of it is 0.
_BANNED_LOGIT = -1.0e4


def _export_spec(model, config, vocab, directory: Path, quantization: str | None,
                 vmap: str | None = None) -> Path:
    """Write ``model`` (aiayn's own subword vocabulary) as a CTranslate2
    ``TransformerSpec``: post-norm (or pre-norm) layers, ReLU FFN, scaled embeddings, the
    model's positional table, decoder started from ``config.model.decoder_start_id``.

    Raises:
        UserError: a setting the specification cannot express (an attention window, an FFN
            activation other than relu, d_k * h != d_model), or a vocabulary of another size
            than the embeddings.
    """
    import numpy as np
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = config.model
    bad = []
    if cfg.d_k * cfg.h != cfg.d_model or cfg.d_v * cfg.h != cfg.d_model:
        bad.append(f"d_k={cfg.d_k}, d_v={cfg.d_v} with h={cfg.h} (CTranslate2: d_model / h)")
    if cfg.attention_window is not None:
        bad.append(f"attention_window={cfg.attention_window}")
    if cfg.ffn_activation != "relu":
        bad.append(f"ffn_activation={cfg.ffn_activation!r} (exported: relu only)")
    if bad:
        raise UserError("CTranslate2's Transformer cannot express this model: " + ", ".join(bad))
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}

    def arr(t):
        return np.ascontiguousarray(t.numpy(), dtype=np.float32)

    def linear(spec, *names):  # one map, or several stacked along the outputs (fused Q/K/V)
        spec.weight = arr(torch.cat([sd[f"{n}.weight"] for n in names]))
        spec.bias = arr(torch.cat([sd[f"{n}.bias"] for n in names]))

    def norm(spec, name):
        spec.gamma, spec.beta = arr(sd[f"{name}.weight"]), arr(sd[f"{name}.bias"])

    pre = cfg.norm == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.N, cfg.N), cfg.h, pre_norm=pre, activation=common_spec.Activation.RELU)
    table = arr(model.positions.table.detach().float().cpu())
    src_emb = sd["src_embed.weight"]
    tgt_emb = sd["tgt_embed.weight"]
    pieces = [vocab.tokenizer.id_to_token(i) for i in range(len(vocab))]
    if len(pieces) != src_emb.shape[0] or tgt_emb.shape[0] != len(pieces):
        raise UserError(f"the vocabulary has {len(pieces)} tokens but the model's embeddings "
                        f"{src_emb.shape[0]} / {tgt_emb.shape[0]} rows")
    # the target vocabulary: the tokens the output layer can produce, and the special ids
    # (PAD, BOS, EOS, UNK: the first four) that CTranslate2's config names
    keep_t = model.output_token_ids(vocab.unk_id + 1)
    if keep_t is None:
        keep_t = torch.arange(len(pieces))
    keep_t = keep_t.cpu()
    keep = keep_t.tolist()
    bias = sd.get("final_logits_bias")

    enc = spec.encoder
    enc.embeddings[0].weight = arr(src_emb)
    enc.position_encodings.encodings = table

    def self_attention_and_ffn(layer, p, attn_norm):  # what both stacks' layers share
        linear(layer.self_attention.linear[0], *(f"{p}.self_attn.W_{x}" for x in "qkv"))
        linear(layer.self_attention.linear[1], f"{p}.self_attn.W_o")
        norm(layer.self_attention.layer_norm, f"{p}.{attn_norm}.norm")
        linear(layer.ffn.linear_0, f"{p}.ffn.W_1")
        linear(layer.ffn.linear_1, f"{p}.ffn.W_2")
        norm(layer.ffn.layer_norm, f"{p}.res_ffn.norm")

    for i, layer in enumerate(enc.layer):
        self_attention_and_ffn(layer, f"encoder.{i}", "res_attn")
    dec = spec.decoder
    dec.embeddings.weight = arr(tgt_emb[keep_t])
    dec.position_encodings.encodings = table
    for i, layer in enumerate(dec.layer):
        p = f"decoder.{i}"
        self_attention_and_ffn(layer, p, "res_self")
        linear(layer.attention.linear[0], f"{p}.cross_attn.W_q")
        linear(layer.attention.linear[1], f"{p}.cross_attn.W_k", f"{p}.cross_attn.W_v")
        linear(layer.attention.linear[2], f"{p}.cross_attn.W_o")
        norm(layer.attention.layer_norm, f"{p}.res_cross.norm")
    if pre:
        norm(enc.layer_norm, "encoder_norm")
        norm(dec.layer_norm, "decoder_norm")
    dec.projection.weight = arr(tgt_emb[keep_t])  # §3.4: the softmax map is the embedding
    out_bias = torch.zeros(len(keep)) if bias is None else bias[keep_t].clone()
    out_bias[torch.isinf(out_bias)] = _BANNED_LOGIT
    dec.projection.bias = arr(out_bias)

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary([pieces[i] for i in keep])
    c = spec.config
    c.layer_norm_epsilon = cfg.layer_norm_eps
    c.bos_token, c.eos_token, c.unk_token = (pieces[vocab.bos_id], pieces[vocab.eos_id],
                                             pieces[vocab.unk_id])
    c.decoder_start_token = pieces[cfg.decoder_start_id]
    c.add_source_eos = True  # the encoder was trained on pieces + EOS (encode_sources)
    if vmap is not None:
        spec.register_vocabulary_mapping(vmap)
    spec.validate()
    spec.optimize(quantization=quantization)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        spec.save(str(tmp))
        # tokenizers' own file (without the kind aiayn adds to its copy)
        (tmp / TOKENIZER).write_text(vocab.tokenizer.to_str(), encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        tmp.replace(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
