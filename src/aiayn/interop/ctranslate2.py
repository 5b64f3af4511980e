"""Export to CTranslate2, through its own converter (``ctranslate2.converters``).

The checkpoint is first written as a Hugging Face Marian directory (:func:`export_hf`), then
``ctranslate2.converters.TransformersConverter`` turns that into a CTranslate2 model. The two
SentencePiece models are copied beside it (``source.spm``, ``target.spm``), so the directory is
all a CTranslate2 user needs::

    translator = ctranslate2.Translator(DIR)
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{DIR}/source.spm")
    pieces = sp.encode(text, out_type=str) + ["</s>"]
    out = translator.translate_batch([pieces], beam_size=4, length_penalty=0.0)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from aiayn.errors import UserError
from aiayn.interop.marian import export_hf


def export_ctranslate2(model, config, vocab, directory: str | Path,
                       quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory computing the same function as ``model``.

    CTranslate2's Marian loader starts the decoder from a zero vector and drops a trailing
    ``<pad>`` from the vocabulary, so the pad embedding must be zero and pad the last id (as in
    every OPUS-MT model).

    Args:
        quantization: CTranslate2's weight type (None: as stored, fp32; "int8", "int8_float32",
            "bfloat16", …).

    Raises:
        UserError: ``ctranslate2`` not installed, or a model CTranslate2's Marian loader would
            not reproduce.
    """
    try:
        import ctranslate2.converters
    except ImportError:
        raise UserError("export to CTranslate2 needs the ctranslate2 package "
                        "(pip install 'aiayn[interop]')") from None
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
            converter.convert(str(directory), quantization=quantization, force=True)
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
