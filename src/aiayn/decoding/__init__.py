"""Decoding, §6.1: greedy, sampling and beam search over the incremental K/V cache."""

from aiayn.decoding.search import (
    CachedStep,
    DecodeStats,
    EnsembleStep,
    Hypothesis,
    LengthRules,
    SamplingConfig,
    ScoreProcessor,
    SearchState,
    StepFunction,
    UncachedStep,
    beam_search,
    greedy_search,
    length_penalty,
    max_output_lengths,
)
from aiayn.decoding.translate import (
    InputTooLongError,
    Translation,
    check_ensemble,
    encode_sources,
    translate_nbest,
)

__all__ = [
    "CachedStep", "DecodeStats", "EnsembleStep", "Hypothesis", "InputTooLongError", "LengthRules",
    "SamplingConfig", "ScoreProcessor", "SearchState", "StepFunction",
    "Translation", "UncachedStep", "beam_search", "check_ensemble", "encode_sources",
    "greedy_search", "length_penalty", "max_output_lengths", "translate_nbest",
]
