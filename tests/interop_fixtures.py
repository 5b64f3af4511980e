"""Tiny random-weight Hugging Face Marian models built locally (no download), for the interop
tests and the peer benchmark."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_corpus(data_dir: Path, lang: str, split: str = "train", limit: int = 3000) -> list[str]:
    with gzip.open(data_dir / "multi30k" / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(limit), f)]


def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
        pad_id=-1, minloglevel=2)
    return prefix.with_suffix(".model")


def make_marian(directory: Path, src_lines: list[str], tgt_lines: list[str], *,
                separate: bool, d_model: int = 32, layers: int = 2, heads: int = 4,
                d_ff: int = 64, spm_size: int = 200, seed: int = 0,
                eos_bias: float = 6.0, activation: str = "swish") -> Path:
    """A random-weight MarianMTModel with its MarianTokenizer files in ``directory``.

    The vocabulary follows OPUS-MT's layout: ``</s>`` 0, ``<unk>`` 1, the pieces, ``<pad>``
    last. ``final_logits_bias`` is random, with ``eos_bias`` added to EOS so that outputs end
    after a few tokens.
    """
    import torch
    from transformers import MarianConfig, MarianMTModel

    directory.mkdir(parents=True, exist_ok=True)
    src_model = train_spm(src_lines, directory / "src", spm_size)
    tgt_model = train_spm(tgt_lines if separate else src_lines + tgt_lines,
                          directory / "tgt", spm_size)
    if not separate:  # a shared vocabulary: one SentencePiece model serves both sides
        src_model = train_spm(src_lines + tgt_lines, directory / "src", spm_size)

    def vocab_of(model: Path) -> dict[str, int]:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(model))
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        out = {"</s>": 0, "<unk>": 1}
        for p in pieces:
            if p not in out and p != "<unk>":
                out[p] = len(out)
        out["<pad>"] = len(out)
        return out

    src_vocab = vocab_of(src_model)
    tgt_vocab = vocab_of(tgt_model) if separate else src_vocab
    (directory / "source.spm").write_bytes(src_model.read_bytes())
    (directory / "target.spm").write_bytes(tgt_model.read_bytes())
    (directory / "vocab.json").write_text(json.dumps(src_vocab), encoding="utf-8")
    if separate:
        (directory / "target_vocab.json").write_text(json.dumps(tgt_vocab), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
        "source_lang": "en", "target_lang": "de", "model_max_length": 512}), encoding="utf-8")
    pad = src_vocab["<pad>"]
    if separate and tgt_vocab["<pad>"] != pad:
        # Marian uses one pad id for both sides: make the target vocabulary as long
        assert len(tgt_vocab) <= len(src_vocab)
        tgt_vocab = {k: v for k, v in tgt_vocab.items() if k != "<pad>"}
        for i in range(len(tgt_vocab), pad):
            tgt_vocab[f"<extra_{i}>"] = i
        tgt_vocab["<pad>"] = pad
        (directory / "target_vocab.json").write_text(json.dumps(tgt_vocab), encoding="utf-8")
    config = MarianConfig(
        vocab_size=len(src_vocab), decoder_vocab_size=len(tgt_vocab), d_model=d_model,
        encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff,
        activation_function=activation, max_position_embeddings=128, scale_embedding=True,
        pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
        share_encoder_decoder_embeddings=not separate, dropout=0.1)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        # larger than the default init, so outputs depend on the source and vary in length
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "shared" in name:
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, 0.25)
            elif "layer_norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.05)
            else:
                p.normal_(0.0, 0.05)
        bias = torch.randn(1, len(tgt_vocab))
        bias[0, 0] += eos_bias
        model.final_logits_bias.copy_(bias)
        model.model.encoder.embed_tokens.weight[pad] = 0.0  # as nn.Embedding(padding_idx)
        model.model.decoder.embed_tokens.weight[pad] = 0.0
    model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(directory)
    return directory
