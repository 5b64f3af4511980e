"""Validation during training: loss and perplexity on the validation pairs, BLEU of a greedy
decode of the first ``train.eval_bleu_sentences`` of them, and what follows from them: the
best checkpoint (``RUN/best``) and early stopping (``train.early_stopping_patience``).

Validation decodes through :mod:`aiayn.decoding` directly; training never imports the
:class:`~aiayn.Translator`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from aiayn.config import Config, DecodeConfig
from aiayn.data.batching import EncodedCorpus, collate, make_batches
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.decoding import translate_nbest
from aiayn.evaluation.bleu import chrf_score, corpus_bleu
from aiayn.rundir import BEST
from aiayn.training.checkpointer import Checkpointer, weights_finite
from aiayn.training.metrics import MetricsSink

if TYPE_CHECKING:
    from aiayn.training.state import TrainState
    from aiayn.training.update import BatchLoss, Learner

# Validation BLEU decodes greedily: it follows the model from one evaluation to the next,
# cheaply; the search (beam size, alpha) is chosen on the validation set once training ends
VALIDATION_BEAM_SIZE = 1

logger = logging.getLogger("aiayn")


def validation_search(decode: DecodeConfig) -> DecodeConfig:
    """The run's ``decode`` settings (lengths, batch size, beam rules) with the search of
    validation: :data:`VALIDATION_BEAM_SIZE`."""
    return dataclasses.replace(decode, beam_size=VALIDATION_BEAM_SIZE)


@torch.no_grad()
def validation_figures(model: nn.Module, batch_loss: BatchLoss, config: Config,
                       vocab: Vocabulary, valid: ParallelCorpus | None,
                       valid_encoded: EncodedCorpus | None,
                       device: torch.device, *, bf16: bool = False) -> dict[str, float]:
    """Validation loss and perplexity (per target subword) and BLEU (the run's protocol,
    :func:`aiayn.evaluation.bleu.bleu_protocol`) and chrF of the first
    ``train.eval_bleu_sentences`` pairs, decoded with :func:`validation_search` of
    ``config.decode``, under bf16 autocast when ``bf16`` (the run's resolved precision).
    Leaves ``model`` in eval mode.

    Returns:
        ``valid_loss``, ``valid_nll``, ``valid_ppl`` (with ``valid_encoded``) and
        ``valid_bleu``, ``valid_chrf`` (with ``valid`` and ``eval_bleu_sentences`` > 0).
    """
    model.eval()
    out: dict[str, float] = {}
    if valid_encoded is not None and len(valid_encoded):
        loss_sum = nll_sum = n = 0.0
        order = make_batches(valid_encoded.src_lengths(), valid_encoded.tgt_lengths(),
                             config.data.max_tokens, shuffle=False)
        for idx in order:
            batch = collate(valid_encoded, idx, start_id=config.model.decoder_start_id)
            loss, nll, k = batch_loss(model, batch.to(device))
            loss_sum, nll_sum, n = loss_sum + float(loss), nll_sum + float(nll), n + k
        out["valid_loss"] = loss_sum / n
        out["valid_nll"] = nll_sum / n
        out["valid_ppl"] = math.exp(min(nll_sum / n, 50.0))
    k = config.train.eval_bleu_sentences
    if valid is not None and k > 0:
        # the corpus is the model's text already (data.preprocess applied on loading)
        found = translate_nbest(model, vocab, valid.src[:k], validation_search(config.decode),
                                bf16=bf16, warn=logger.warning)
        hyps = [t[0].text for t in found]
        refs = valid.tgt[:k]
        out["valid_bleu"] = corpus_bleu(hyps, refs, config.data)["bleu"]
        out["valid_chrf"] = chrf_score(hyps, refs)[0]
    return out


class Evaluator:
    """Validates between updates, keeps the best weights in ``RUN/best`` and says when to stop
    early. Only the main process validates; the others' verdicts come from the main's
    (:func:`~aiayn.training.distributed.main_decides`).

    The best metric is validation BLEU, or -loss when BLEU is off; it and the count of
    evaluations since it improved live in the :class:`~aiayn.training.state.TrainState`, so
    a resumed run tracks them on.

    Args:
        config: the run's config (``train.eval_bleu_sentences``,
            ``train.early_stopping_patience``, ``decode``, ``data``).
        valid: raw validation pairs (BLEU) and ``valid_encoded`` their encoding (loss).
        checkpointer: writes ``best/``.
        metrics: receives a ``valid`` record per evaluation.
        is_main: whether this process validates.
    """

    def __init__(self, config: Config, vocab: Vocabulary, valid: ParallelCorpus | None,
                 valid_encoded: EncodedCorpus | None, checkpointer: Checkpointer,
                 metrics: MetricsSink, is_main: bool = True) -> None:
        self.config, self.vocab = config, vocab
        self.valid, self.valid_encoded = valid, valid_encoded
        self.checkpointer, self.metrics, self.is_main = checkpointer, metrics, is_main
        self.patience = config.train.early_stopping_patience

    def figures(self, learner: Learner) -> dict[str, float]:
        """Validation figures of ``learner``'s master weights (:func:`validation_figures`)."""
        return validation_figures(learner.model, learner.batch_loss, self.config, self.vocab,
                                  self.valid, self.valid_encoded, learner.device,
                                  bf16=learner.precision.uses_bf16)

    def evaluate(self, learner: Learner) -> dict[str, float]:
        """Validate (main process), replace ``best/`` when the metric improved, count the
        evaluations without improvement; returns the figures ({} on other processes)."""
        if not self.is_main:
            return {}
        t0 = time.monotonic()
        figures = self.figures(learner)
        figures["valid_seconds"] = time.monotonic() - t0
        metric = figures.get("valid_bleu", -figures.get("valid_loss", float("inf")))
        s = learner.state
        better = math.isfinite(metric) and (s.best_metric is None or metric > s.best_metric)
        if better and weights_finite(learner.model):
            s.best_metric = metric
            s.evals_since_best = 0
            meta = {"step": s.step, **{k: round(v, 4) for k, v in figures.items()}}
            self.checkpointer.save_named(BEST, learner.model, meta)
        else:
            s.evals_since_best += 1
        self.metrics.log({"kind": "valid", "step": s.step, "elapsed_s": round(s.elapsed_s, 2),
                          **figures})
        return figures

    def stop_early(self, state: TrainState) -> bool:
        """Whether ``train.early_stopping_patience`` evaluations in a row have not improved on
        the best (read on the main process, which alone counts them)."""
        return bool(self.patience) and state.evals_since_best >= self.patience


__all__ = ["VALIDATION_BEAM_SIZE", "Evaluator", "validation_figures", "validation_search"]
