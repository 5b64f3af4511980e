"""The Transformer model, §3."""

from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import (
    DecoderLayer,
    Dropout,
    EncoderLayer,
    MultiHeadAttention,
    PositionalEncoding,
    PositionwiseFeedForward,
    Transformer,
    count_parameters,
    sinusoid_table,
)

__all__ = [
    "DecoderCache",
    "DecoderLayer",
    "Dropout",
    "EncoderLayer",
    "MultiHeadAttention",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "Transformer",
    "count_parameters",
    "sinusoid_table",
]
