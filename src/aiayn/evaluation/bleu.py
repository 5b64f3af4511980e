"""BLEU in three protocols, each labelled, so scores compare with the right literature.

1. **sacreBLEU** (the default, recommended): detokenized hypotheses against raw references,
   sacreBLEU's own tokenizer, with its signature. Also chrF.
2. **paper** (tokenized BLEU as in Table 2 of the paper and the tensor2tensor
   ``get_ende_bleu.sh`` script): Moses-tokenize hypotheses and references, split hyphenated
   compounds as ``a ##AT##-##AT## b`` (EN-DE), then BLEU on tokens. Numbers run higher than
   sacreBLEU and are not comparable with it.
3. **multi30k** (the Multi30k literature): lowercase, Moses punctuation normalization, Moses
   tokenization with escaping, scored with sacreBLEU ``tokenize='none'`` against the shared
   pre-tokenized references (``multi30k/tok/*.lc.norm.tok.*``).

All functions take hypotheses and references as lists of lines, one per segment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.data.corpus import decode_line
from aiayn.data.corpus import read_lines as read_corpus_lines
from aiayn.data.text import is_protocol_text, moses, multi30k_tokenize
from aiayn.errors import DataError

if TYPE_CHECKING:
    from aiayn.config import DataConfig

PROTOCOLS = {
    "sacrebleu": "sacreBLEU on detokenized text (cased, 13a tokenizer)",
    "paper": "tokenized BLEU as in the paper's Table 2 (Moses tokenizer, ##AT## compound "
             "splitting for German, cased)",
    "multi30k": "Multi30k literature protocol (lowercased, Moses-normalized and -tokenized, "
                "sacreBLEU tokenize='none')",
}


def _check_aligned(hyps: list[str], refs: list[str]) -> None:
    if len(hyps) != len(refs):
        raise DataError(f"{len(hyps)} hypotheses but {len(refs)} references: the files must be "
                        "line-aligned")


def sacrebleu_scores(hyps: list[str], refs: list[str]) -> dict:
    """sacreBLEU BLEU and chrF of detokenized ``hyps`` against one reference per line.

    Returns:
        dict with ``bleu`` and ``chrf`` (floats, 0-100) and ``bleu_signature``,
        ``chrf_signature`` (sacreBLEU's reproducibility strings).

    Raises:
        DataError: the two lists differ in length.
    """
    from sacrebleu.metrics import BLEU, CHRF

    _check_aligned(hyps, refs)
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def chrf_score(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """sacreBLEU chrF (0-100) of ``hyps`` against one reference per line, with its signature.

    Raises:
        DataError: the two lists differ in length.
    """
    from sacrebleu.metrics import CHRF

    _check_aligned(hyps, refs)
    chrf = CHRF()
    return chrf.corpus_score(hyps, [refs]).score, str(chrf.get_signature())


# --- the paper's tokenized BLEU --------------------------------------------------------------

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """``rich-text`` -> ``rich ##AT##-##AT## text``, the compound splitting that GNMT, ConvS2S
    and the Transformer's EN-DE scores used. Like the Perl ``s{(\\S)-(\\S)}{…}g`` it mirrors,
    matches do not overlap: in ``x-y-z`` (one-letter parts) only the first hyphen is split."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def paper_tokenize(line: str, lang: str, compounds: bool | None = None) -> str:
    """One line as the paper's tokenized BLEU sees it: Unicode punctuation replaced, Moses
    tokenization (escaped, as ``tokenizer.perl`` does by default), and for German (or when
    ``compounds`` is True) ``##AT##`` compound splitting."""
    normalizer, tokenizer = moses(lang)
    text = normalizer.replace_unicode_punct(line)
    text = tokenizer.tokenize(text, escape=True, return_str=True)
    if compounds if compounds is not None else lang == "de":
        text = split_compounds(text)
    return text


def paper_tok_bleu(hyps: list[str], refs: list[str], lang: str,
                   compounds: bool | None = None) -> float:
    """Tokenized, cased BLEU in the style of the paper's Table 2 (``get_ende_bleu.sh``): both
    sides Moses-tokenized, German compounds split, then BLEU on the tokens (sacreBLEU with
    ``tokenize='none'``, which equals ``multi-bleu.perl`` at corpus level).

    Args:
        hyps, refs: detokenized lines; lang: target language code (e.g. "de").

    Raises:
        DataError: the two lists differ in length.
    """
    from sacrebleu.metrics import BLEU

    _check_aligned(hyps, refs)
    tok_h = [paper_tokenize(h, lang, compounds) for h in hyps]
    tok_r = [paper_tokenize(r, lang, compounds) for r in refs]
    return BLEU(tokenize="none", force=True).corpus_score(tok_h, [tok_r]).score


# short names of the protocols a run reports in, for figure titles
PROTOCOL_TITLES = {"sacrebleu": "sacreBLEU cased", "paper": "tokenized, as the paper",
                   "multi30k": "Multi30k protocol"}


def bleu_protocol(data: "DataConfig") -> str:
    """Which BLEU a run on ``data`` reports (a key of :data:`PROTOCOLS`): the Multi30k
    protocol for a model that writes its text (``data.preprocess`` = ``lc-norm-tok``) or any
    Multi30k run, else sacreBLEU. The one statement of the rule; :func:`corpus_bleu` scores by
    it, and records and titles name it."""
    if is_protocol_text(data.preprocess) or data.dataset == "multi30k":
        return "multi30k"
    return "sacrebleu"


def corpus_bleu(hyps: list[str], refs: list[str], data: "DataConfig") -> dict:
    """The BLEU a run reports on its own corpus (validation, Table 3's dev set, the main job's
    val choices): the one rule for which protocol that is.

    ``hyps`` are the model's outputs and ``refs`` the corpus text as loaded, so both are under
    ``data.preprocess`` already. The protocol is :func:`bleu_protocol`'s. A model trained on the
    Multi30k protocol's text is scored as it writes; other text is put into the protocol's form
    first; sacreBLEU scores cased, detokenized text.

    Returns:
        dict with ``bleu`` (0-100), ``protocol`` (a key of :data:`PROTOCOLS`) and
        ``signature`` (sacreBLEU's, or the protocol's description).

    Raises:
        DataError: the two lists differ in length.
    """
    if bleu_protocol(data) == "multi30k":
        pretokenized = is_protocol_text(data.preprocess)
        ref_tok = refs if pretokenized else [multi30k_tokenize(r, data.tgt_lang) for r in refs]
        return {"bleu": multi30k_tok_bleu(hyps, ref_tok, data.tgt_lang,
                                          pretokenized=pretokenized),
                "protocol": "multi30k", "signature": PROTOCOLS["multi30k"]}
    scores = sacrebleu_scores(hyps, refs)
    return {"bleu": scores["bleu"], "protocol": "sacrebleu",
            "signature": scores["bleu_signature"]}


# --- the Multi30k literature's protocol ------------------------------------------------------


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` read transparently), without line endings and
    otherwise unchanged (scoring sees the text exactly as written).

    Raises:
        FileNotFoundError: no such file.
        DataError: invalid UTF-8 (with the line number) or a broken gzip stream.
    """
    return read_corpus_lines(path, strip=False)


def decode_lines(data: bytes, name: str) -> list[str]:
    """Split bytes on ``\\n`` only (``\\r\\n`` tolerated) and decode each line as UTF-8.

    Only ``\\n`` ends a line, so characters such as U+2028 or form feeds inside a sentence keep
    files line-aligned. A final line without ``\\n`` counts; a trailing ``\\n`` adds no line.

    Raises:
        DataError: a line that is not valid UTF-8, naming ``name`` and the 1-based line number.
    """
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    return [decode_line(line[:-1] if line.endswith(b"\r") else line, name, n)
            for n, line in enumerate(raw, 1)]


def multi30k_tok_bleu(hyps: list[str], ref_tok: list[str] | str | Path, lang: str, *,
                      pretokenized: bool = False) -> float:
    """BLEU in the Multi30k literature's protocol: ``hyps`` (detokenized) pass through
    :func:`multi30k_tokenize`; ``ref_tok`` are the already tokenized references, as lines or a
    path (e.g. ``$AIAYN_DATA_DIR/multi30k/tok/test_2016_flickr.lc.norm.tok.de.gz``); scored with
    sacreBLEU ``tokenize='none'``.

    Args:
        pretokenized: ``hyps`` are already in the protocol's form (a model trained with
            ``data.preprocess = "lc-norm-tok"``): scored as they are, since tokenizing twice
            would escape ``&amp;`` again.

    Raises:
        FileNotFoundError / DataError: unreadable reference file, or unaligned line counts.
    """
    from sacrebleu.metrics import BLEU

    refs = read_lines(ref_tok) if isinstance(ref_tok, (str, Path)) else list(ref_tok)
    _check_aligned(hyps, refs)
    tok_h = list(hyps) if pretokenized else [multi30k_tokenize(h, lang) for h in hyps]
    return BLEU(tokenize="none", force=True).corpus_score(tok_h, [refs]).score
