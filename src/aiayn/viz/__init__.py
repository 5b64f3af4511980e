"""Looking inside a trained model: the attention weights of one translation, and drawings of
them in the style of the paper's Figures 3-5."""

from aiayn.viz.attention import (
    KINDS,
    AttentionMaps,
    AttentionRecord,
    attention_maps,
    record_attention,
)

__all__ = ["KINDS", "AttentionMaps", "AttentionRecord", "attention_maps", "record_attention"]
