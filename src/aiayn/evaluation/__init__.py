"""Evaluation: BLEU and chrF in labelled protocols (see :mod:`aiayn.evaluation.bleu`)."""

from aiayn.evaluation.bleu import (
    PROTOCOL_TITLES,
    PROTOCOLS,
    bleu_protocol,
    corpus_bleu,
    decode_lines,
    multi30k_tok_bleu,
    multi30k_tokenize,
    paper_tok_bleu,
    paper_tokenize,
    read_lines,
    sacrebleu_scores,
    split_compounds,
)

__all__ = [
    "PROTOCOL_TITLES", "PROTOCOLS", "bleu_protocol", "corpus_bleu", "decode_lines", "multi30k_tok_bleu", "multi30k_tokenize", "paper_tok_bleu",
    "paper_tokenize", "read_lines", "sacrebleu_scores", "split_compounds",
]
