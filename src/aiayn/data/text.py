"""Text preprocessing applied before subword segmentation (``data.preprocess``).

- ``none``: the corpus as distributed (cased, detokenized); outputs are real-cased text, scored
  with sacreBLEU.
- ``lc-norm-tok``: the Multi30k literature's text (Elliott et al. 2016 and the papers that
  report on it): lowercased, punctuation-normalized and tokenized with sacremoses'
  ``MosesPunctNormalizer`` and ``MosesTokenizer(escape=True)``. Applied to the raw
  ``test_2016_flickr`` targets it reproduces the shipped ``tok/*.lc.norm.tok.*`` references
  line for line, so outputs are scored against them directly (sacreBLEU with
  ``tokenize='none'``). Outputs stay lowercased and tokenized.

A model trained on preprocessed text records the mode in its ``config.json``; ``aiayn
translate`` and ``aiayn serve`` apply it to their input the same way.
"""

from __future__ import annotations

from aiayn.config import PREPROCESS_MODES
from aiayn.data.corpus import ParallelCorpus


def preprocess_lines(lines: list[str], lang: str, mode: str) -> list[str]:
    """``lines`` of language ``lang`` (an ISO code such as ``de``) under ``mode``.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "none":
        return list(lines)
    if mode == "lc-norm-tok":
        from aiayn.evaluation.bleu import multi30k_tokenize

        return [multi30k_tokenize(line, lang) for line in lines]
    raise ValueError(f"unknown data.preprocess {mode!r}; known: {', '.join(PREPROCESS_MODES)}")


def preprocess_corpus(corpus: ParallelCorpus, src_lang: str, tgt_lang: str,
                      mode: str) -> ParallelCorpus:
    """Both sides of ``corpus`` under ``mode`` (the same object back for ``none``)."""
    if mode == "none":
        return corpus
    return ParallelCorpus(preprocess_lines(corpus.src, src_lang, mode),
                          preprocess_lines(corpus.tgt, tgt_lang, mode),
                          f"{corpus.name} ({mode})", corpus.dropped_empty)
