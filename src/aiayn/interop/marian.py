"""Hugging Face Marian (OPUS-MT) models to aiayn checkpoints and back.

A Marian model is the Transformer of §3 with these differences, each a :class:`ModelConfig`
option that a converted checkpoint sets (and a paper-faithful one leaves at the paper's choice):

=======================  ===========================  ========================================
Marian                   ModelConfig field             paper default
=======================  ===========================  ========================================
swish FFN activation     ``ffn_activation="swish"``   ``"relu"`` (§3.3)
sines, then cosines      ``positional_layout=         ``"interleaved"`` (§3.5)
                         "halves"``
``final_logits_bias``    ``final_logits_bias=True``   False
decoder starts with pad  ``decoder_start_id=0``        1 (BOS)
LayerNorm eps 1e-5       ``layer_norm_eps=1e-5``       1e-6
separate vocabularies    ``share_embeddings=False``    True (§3.4)
=======================  ===========================  ========================================

Token ids. aiayn fixes 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, 3 ``<unk>``; Marian has ``</s>``,
``<unk>`` and ``<pad>`` wherever its ``vocab.json`` puts them, and no ``<s>``. Import reorders
the vocabulary to ``[pad, <s>, </s>, <unk>, every other piece in Marian order]``: the embedding
rows and ``final_logits_bias`` are permuted alike, and the new ``<s>`` row is a zero embedding
whose logit bias is -inf, so it takes no probability mass and the softmax over the other tokens
is unchanged. Export applies the inverse permutation (the Marian ids of pad, EOS and unk are
kept in the vocabulary), so a round trip gives back the same ids.

Search settings. ``generate`` divides a beam hypothesis' log-probability by ``|Y| **
length_penalty``; §6.1 divides by ``((5 + |Y|) / 6) ** alpha``. The two agree at 0
(``--alpha 0`` here, ``length_penalty=0.0`` there: rank by log-probability). OPUS-MT's
generation config also bans ``<pad>`` (``bad_words_ids``), as aiayn's search always does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config, DecodeConfig, ModelConfig
from aiayn.data.sentencepiece_vocab import SentencePieceVocabulary
from aiayn.errors import UserError
# Hugging Face's file names, which aiayn's checkpoints and run directories share
from aiayn.rundir import CONFIG, GENERATION_CONFIG, WEIGHTS

ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found (is {path.parent} a Hugging Face Marian "
                        "model directory?)") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors``, else ``pytorch_model.bin`` loaded with ``weights_only=True``."""
    st = directory / WEIGHTS
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = directory / "pytorch_model.bin"
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise UserError(f"{directory}: no model.safetensors or pytorch_model.bin")


def _permutation(vocab: dict[str, int], pad: int, eos: int, unk: int, size: int) -> list[int]:
    """Marian id of each aiayn id (-1 for the new ``<s>``)."""
    for name, i in (("pad", pad), ("eos", eos), ("unk", unk)):
        if not 0 <= i < size:
            raise UserError(f"the Marian {name} id {i} is outside the vocabulary of {size}")
    rest = [i for i in range(size) if i not in (pad, eos, unk)]
    return [pad, -1, eos, unk, *rest]


def _pieces(vocab: dict[str, int], perm: list[int], where: str) -> list[str]:
    by_id = {i: p for p, i in vocab.items()}
    out = []
    for i in perm:
        if i == -1:
            out.append("<s>")
        elif i in by_id:
            out.append(by_id[i])
        else:
            raise UserError(f"{where}: no piece has id {i}")
    return out


def _rows(weight: torch.Tensor, perm: list[int], fill: float = 0.0) -> torch.Tensor:
    """Rows of ``weight`` in aiayn order; the ``<s>`` row (perm -1) is ``fill``."""
    index = torch.tensor([max(i, 0) for i in perm])
    out = weight.index_select(0, index).clone()
    out[1] = fill
    return out


_LAYER_NAMES = {  # Hugging Face suffix -> aiayn suffix, per layer
    "encoder": {"self_attn.q_proj": "self_attn.W_q", "self_attn.k_proj": "self_attn.W_k",
                "self_attn.v_proj": "self_attn.W_v", "self_attn.out_proj": "self_attn.W_o",
                "self_attn_layer_norm": "res_attn.norm", "fc1": "ffn.W_1", "fc2": "ffn.W_2",
                "final_layer_norm": "res_ffn.norm"},
    "decoder": {"self_attn.q_proj": "self_attn.W_q", "self_attn.k_proj": "self_attn.W_k",
                "self_attn.v_proj": "self_attn.W_v", "self_attn.out_proj": "self_attn.W_o",
                "self_attn_layer_norm": "res_self.norm",
                "encoder_attn.q_proj": "cross_attn.W_q", "encoder_attn.k_proj": "cross_attn.W_k",
                "encoder_attn.v_proj": "cross_attn.W_v",
                "encoder_attn.out_proj": "cross_attn.W_o",
                "encoder_attn_layer_norm": "res_cross.norm", "fc1": "ffn.W_1", "fc2": "ffn.W_2",
                "final_layer_norm": "res_ffn.norm"},
}


def import_hf(directory: str | Path):
    """Read a Hugging Face ``MarianMTModel`` directory (``config.json``, weights,
    ``source.spm``, ``target.spm``, ``vocab.json`` [, ``target_vocab.json``]).

    Returns:
        (model, config, vocab): an eval-mode :class:`~aiayn.model.Transformer` computing the
        same function, its :class:`Config`, and a :class:`SentencePieceVocabulary`.

    Raises:
        UserError: a missing file, or a Marian variant that aiayn cannot express (the message
            names the setting).
    """
    from aiayn.model import Transformer

    directory = Path(directory)
    hf = _read_json(directory / CONFIG)
    if hf.get("model_type") != "marian":
        raise UserError(f"{directory / CONFIG}: model_type is {hf.get('model_type')!r}, "
                        "only 'marian' (MarianMTModel, OPUS-MT) is supported")
    tok_cfg_path = directory / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    N = hf["encoder_layers"]
    checks = {"decoder_layers": N, "decoder_attention_heads": hf["encoder_attention_heads"],
              "decoder_ffn_dim": hf["encoder_ffn_dim"], "scale_embedding": True,
              "normalize_before": False, "add_final_layer_norm": False}
    for key, want in checks.items():
        if key in hf and hf[key] != want:
            raise UserError(f"{directory / CONFIG}: {key}={hf[key]!r} is not supported "
                            f"(aiayn needs {want!r})")
    activation = ACTIVATIONS.get(hf.get("activation_function", "swish"))
    if activation is None:
        raise UserError(f"{directory / CONFIG}: activation_function="
                        f"{hf.get('activation_function')!r} is not supported (swish or relu)")
    separate = bool(tok_cfg.get("separate_vocabs", False))
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    src_vocab = _read_json(directory / "vocab.json")
    tgt_vocab = _read_json(directory / "target_vocab.json") if separate else src_vocab
    V_src = hf["vocab_size"]
    V_tgt = hf.get("decoder_vocab_size") or V_src
    pad, eos = hf["pad_token_id"], hf["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    unk_piece = tok_cfg.get("unk_token", "<unk>")
    if unk_piece not in src_vocab or unk_piece not in tgt_vocab:
        raise UserError(f"{directory / 'vocab.json'}: no {unk_piece!r} piece")
    if hf.get("decoder_start_token_id", pad) != pad:
        raise UserError(f"{directory / CONFIG}: decoder_start_token_id="
                        f"{hf['decoder_start_token_id']} is not the pad id {pad}; only Marian's "
                        "pad start is supported")
    src_perm = _permutation(src_vocab, pad, eos, src_vocab[unk_piece], V_src)
    tgt_perm = _permutation(tgt_vocab, pad, eos, tgt_vocab[unk_piece], V_tgt)

    d_model, h = hf["d_model"], hf["encoder_attention_heads"]
    cfg = ModelConfig(
        N=N, d_model=d_model, d_ff=hf["encoder_ffn_dim"], h=h, d_k=d_model // h,
        d_v=d_model // h, P_drop=float(hf.get("dropout", 0.1)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)), vocab_size=len(src_perm),
        tgt_vocab_size=None if shared else len(tgt_perm), share_embeddings=shared,
        max_len=hf.get("max_position_embeddings", 512), layer_norm_eps=1e-5, pad_id=0,
        ffn_activation=activation, positional_layout="halves", final_logits_bias=True,
        decoder_start_id=0)
    gen_path = directory / GENERATION_CONFIG
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    decode = DecodeConfig(beam_size=int(gen.get("num_beams", hf.get("num_beams", 4)) or 1),
                          alpha=0.0, max_len_a=0.0, beam_rules="hf",
                          max_len_b=int(gen.get("max_length", hf.get("max_length", 512))) - 2)
    config = Config(name=f"marian:{directory.name}", model=cfg, decode=decode)

    w = _read_hf_weights(directory)
    w = {k.removeprefix("model."): v for k, v in w.items()}
    state: dict[str, torch.Tensor] = {}
    src_emb = w.get("shared.weight", w.get("encoder.embed_tokens.weight"))
    tgt_emb = w.get("decoder.embed_tokens.weight", src_emb) if not shared else src_emb
    if src_emb is None or tgt_emb is None:
        raise UserError(f"{directory}: no embedding matrix (shared.weight) in the weights")
    state["src_embed.weight"] = _rows(src_emb, src_perm)
    if not shared:
        state["tgt_embed.weight"] = _rows(tgt_emb, tgt_perm)
    lm_head = w.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head, tgt_emb):
        raise UserError(f"{directory}: lm_head.weight is not tied to the target embeddings; "
                        "aiayn ties them (§3.4)")
    bias = w.get("final_logits_bias", torch.zeros(1, V_tgt)).reshape(-1)
    state["final_logits_bias"] = _rows(bias[:, None], tgt_perm, float("-inf")).reshape(-1)
    for stack in ("encoder", "decoder"):
        for i in range(N):
            for hf_name, name in _LAYER_NAMES[stack].items():
                for p in ("weight", "bias"):
                    key = f"{stack}.layers.{i}.{hf_name}.{p}"
                    if key not in w:
                        raise UserError(f"{directory}: weight {key} is missing")
                    state[f"{stack}.{i}.{name}.{p}"] = w[key]
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (shared and k.startswith("tgt_embed"))]
    assert not missing and not unexpected, (missing, unexpected)
    vocab = SentencePieceVocabulary(
        (directory / "source.spm").read_bytes(), (directory / "target.spm").read_bytes(),
        _pieces(src_vocab, src_perm, str(directory / "vocab.json")),
        _pieces(tgt_vocab, tgt_perm, str(directory / "target_vocab.json")) if separate else None,
        decode_with="target" if separate else "source",
        special_pieces=[tok_cfg.get(k, d) for k, d in
                        (("pad_token", "<pad>"), ("eos_token", "</s>"), ("unk_token", "<unk>"))],
        marian_ids={"pad": pad, "eos": eos, "unk_src": src_vocab[unk_piece],
                    "unk_tgt": tgt_vocab[unk_piece]})
    return model.eval(), config, vocab


def export_hf(model, config: Config, vocab, directory: str | Path) -> Path:
    """Write a Hugging Face ``MarianMTModel`` directory computing the same function.

    Works for checkpoints converted from Marian (SentencePiece vocabularies). Ids go back to
    their Marian places (see the module docstring).

    Raises:
        UserError: a checkpoint Marian cannot express (the message names the setting).
    """
    cfg: ModelConfig = config.model
    if not isinstance(vocab, SentencePieceVocabulary):
        raise UserError("export to Hugging Face needs a checkpoint with SentencePiece "
                        "vocabularies (one converted from Marian); this one has aiayn's "
                        "own subword vocabulary, which MarianTokenizer cannot read")
    problems = {"norm": ("post", cfg.norm), "positional": ("sinusoidal", cfg.positional),
                "positional_layout": ("halves", cfg.positional_layout),
                "decoder_start_id": (0, cfg.decoder_start_id)}
    bad = [f"{k}={got!r} (Marian: {want!r})" for k, (want, got) in problems.items()
           if want != got]
    if cfg.d_k * cfg.h != cfg.d_model or cfg.d_v * cfg.h != cfg.d_model:
        bad.append(f"d_k={cfg.d_k}, d_v={cfg.d_v} with h={cfg.h} (Marian: d_model / h)")
    if bad:
        raise UserError("Marian cannot express this model: " + ", ".join(bad))
    ids = vocab.marian_ids
    V_src, V_tgt = len(vocab), vocab.target_size
    # Marian order: the aiayn rows without <s>, pad/eos/unk back at their Marian ids
    pad = ids.get("pad", V_src - 2)
    eos = ids.get("eos", 0)

    def inverse(size: int, unk: int) -> list[int]:
        perm = _permutation({}, pad, eos, unk, size - 1)  # Marian id of each aiayn id
        inv = [0] * (size - 1)
        for ours, marian in enumerate(perm):
            if marian >= 0:
                inv[marian] = ours
        return inv  # aiayn id of each Marian id

    src_inv = inverse(V_src, ids.get("unk_src", 1))
    tgt_inv = inverse(V_tgt, ids.get("unk_tgt", 1))
    sd = model.state_dict()
    w: dict[str, torch.Tensor] = {}
    src_emb = sd["src_embed.weight"][src_inv]
    shared = cfg.share_embeddings
    w["model.shared.weight"] = src_emb
    w["model.encoder.embed_tokens.weight"] = src_emb
    tgt_emb = src_emb if shared else sd["tgt_embed.weight"][tgt_inv]
    w["model.decoder.embed_tokens.weight"] = tgt_emb
    w["lm_head.weight"] = tgt_emb
    bias = sd.get("final_logits_bias")
    w["final_logits_bias"] = (torch.zeros(1, V_tgt - 1) if bias is None
                              else bias[tgt_inv].reshape(1, -1))
    for stack in ("encoder", "decoder"):
        for i in range(cfg.N):
            for hf_name, name in _LAYER_NAMES[stack].items():
                for p in ("weight", "bias"):
                    w[f"model.{stack}.layers.{i}.{hf_name}.{p}"] = sd[f"{stack}.{i}.{name}.{p}"]
    hf_config = {
        "architectures": ["MarianMTModel"], "model_type": "marian",
        "activation_function": cfg.ffn_activation, "d_model": cfg.d_model,
        "encoder_layers": cfg.N, "decoder_layers": cfg.N,
        "encoder_attention_heads": cfg.h, "decoder_attention_heads": cfg.h,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "dropout": cfg.P_drop, "attention_dropout": cfg.attention_dropout,
        "activation_dropout": 0.0, "max_position_embeddings": cfg.max_len,
        "vocab_size": V_src - 1, "decoder_vocab_size": V_tgt - 1,
        "share_encoder_decoder_embeddings": shared, "tie_word_embeddings": True,
        "scale_embedding": True, "pad_token_id": pad, "eos_token_id": eos,
        "decoder_start_token_id": pad, "forced_eos_token_id": eos, "is_encoder_decoder": True,
        "num_beams": config.decode.beam_size,
    }
    if not math.isclose(cfg.layer_norm_eps, 1e-5):
        raise UserError(f"Marian's LayerNorm epsilon is 1e-5; this model has "
                        f"layer_norm_eps={cfg.layer_norm_eps}")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in w.items()},
                  str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
        gen = {"decoder_start_token_id": pad, "eos_token_id": eos, "pad_token_id": pad,
               "forced_eos_token_id": eos, "bad_words_ids": [[pad]],
               "num_beams": config.decode.beam_size, "max_length": config.decode.max_len_b + 2}
        (tmp / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2), encoding="utf-8")
        (tmp / "source.spm").write_bytes(vocab.source_spm_bytes)
        (tmp / "target.spm").write_bytes(vocab.target_spm_bytes)
        src_pieces = [vocab.source_pieces[i] for i in src_inv]
        (tmp / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(src_pieces)},
                                                   ensure_ascii=False), encoding="utf-8")
        separate = vocab.target_pieces is not None
        if separate:
            tgt_pieces = [vocab.output_pieces[i] for i in tgt_inv]
            (tmp / "target_vocab.json").write_text(
                json.dumps({p: i for i, p in enumerate(tgt_pieces)}, ensure_ascii=False),
                encoding="utf-8")
        special = vocab.special_pieces
        tok_cfg = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
                   "pad_token": special[0], "eos_token": special[1], "unk_token": special[2],
                   "model_max_length": cfg.max_len}
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2),
                                                   encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
