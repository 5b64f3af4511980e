"""Data: subword vocabularies, corpora and token-based batching, §5.1."""
