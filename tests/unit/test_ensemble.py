"""Ensemble decoding: :class:`EnsembleStep` averages its members' next-token probabilities, on
real (random-weight) Transformers, through beam search, int8 copies and translate_nbest."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import load_config
from aiayn.data.batching import pad_sources
from aiayn.data.vocab import BOS_ID, EOS_ID, Vocabulary
from aiayn.decoding import CachedStep, EnsembleStep, StepFunction
from aiayn.translator import Translator
from aiayn.model import Transformer

TEXTS = ["a man is walking down the street with a dog",
         "two children play football in the park",
         "ein mann geht mit einem hund die straße entlang",
         "zwei kinder spielen fußball im park"] * 10
LINES = ["a man", "two children play football in the park with a dog", "zwei kinder",
         "ein mann geht", "the park"]


def tiny_model(vocab_size: int, seed: int) -> Transformer:
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper distributions than a fresh init's, so members disagree
        model.tgt_embed.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.learn(TEXTS, 80)


@pytest.fixture(scope="module")
def members(vocab) -> list[Transformer]:
    return [tiny_model(len(vocab), seed) for seed in (1, 2, 3)]


def mean_log_probs(models, src: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """log of the members' mean next-token probability after each prefix position, from the
    whole-prefix decoder (no cache): (n, t, V)."""
    probs = []
    for model in models:
        memory, mask = model.encode(src)
        probs.append(F.softmax(model.decode(prefix, memory, mask).float(), dim=-1))
    return torch.stack(probs).mean(dim=0).log()


def test_ensemble_step_is_the_log_of_the_mean_probability(members, vocab):
    src = pad_sources([vocab.encode(x) + [EOS_ID] for x in LINES[:3]])  # (3, S)
    with torch.no_grad():
        steps = [CachedStep.start(m, *m.encode(src)) for m in members]
        step = EnsembleStep(steps)
        prefix = torch.full((3, 1), BOS_ID)
        got = [step(prefix[:, 0])]
        # feed tokens, reorder rows (as beam search does) and feed again
        for tokens, index in (([7, 9, 11], None), ([12, 13, 14], [2, 0, 0])):
            if index is not None:
                index = torch.tensor(index)
                step, src, prefix = step.select(index), src[index], prefix[index]
                got = [g[index] for g in got]
            prefix = torch.cat([prefix, torch.tensor(tokens)[:, None]], dim=1)
            got.append(step(prefix[:, -1]))
        want = mean_log_probs(members, src, prefix)  # (3, 3, V)
    assert torch.stack(got, dim=1).shape == want.shape
    torch.testing.assert_close(torch.stack(got, dim=1), want, atol=1e-5, rtol=1e-5)
    # members that disagree: the ensemble is neither of them
    one = mean_log_probs(members[:1], src, prefix)
    assert (one - want).abs().max() > 0.1


def test_a_token_one_member_forbids_keeps_the_others_share():
    class Fixed(StepFunction):
        start_id = BOS_ID

        def __init__(self, logits):
            self.logits = torch.tensor(logits)

        def __call__(self, tokens):
            return self.logits.expand(tokens.shape[0], -1)

        def select(self, index):
            return self

    inf = float("-inf")
    p = EnsembleStep([Fixed([0.0, inf, 1.0]), Fixed([0.0, 2.0, 1.0])])(torch.zeros(2)).exp()
    q = F.softmax(torch.tensor([0.0, 2.0, 1.0]), dim=0)
    r = F.softmax(torch.tensor([0.0, inf, 1.0]), dim=0)
    torch.testing.assert_close(p[0], (q + r) / 2)
    assert float(p[0, 1]) == pytest.approx(float(q[1]) / 2)
    assert float(p[0].sum()) == pytest.approx(1.0)


def test_an_ensemble_of_one_model_twice_is_that_model(members, vocab):
    one = Translator(members[0], vocab, precision="fp32").generate(LINES, beam_size=4, nbest=2,
                                                                   max_len_b=8)
    twice = Translator([members[0], members[0]], vocab, precision="fp32").generate(
        LINES, beam_size=4, nbest=2, max_len_b=8)
    assert [[t.tokens for t in r] for r in twice] == [[t.tokens for t in r] for r in one]
    for a, b in zip(one, twice):
        assert [t.score for t in b] == pytest.approx([t.score for t in a], abs=1e-4)


def test_ensemble_translations_score_the_mean_probability(members, vocab):
    """The log_prob beam search reports for an ensemble's output is the sum of the log mean
    probabilities of its tokens, recomputed here without the cache."""
    out = Translator(members, vocab, precision="fp32").generate(LINES, beam_size=4, max_len_b=8)
    singles = [Translator(m, vocab, precision="fp32").generate(LINES, beam_size=4, max_len_b=8)
               for m in members]
    with torch.no_grad():
        for line, (t,) in zip(LINES, out):
            src = torch.tensor([vocab.encode(line) + [EOS_ID]])
            prefix = torch.tensor([[BOS_ID] + t.tokens[:-1]])
            logp = mean_log_probs(members, src, prefix)[0]
            want = float(logp.gather(1, torch.tensor(t.tokens)[:, None]).sum())
            assert t.log_prob == pytest.approx(want, abs=1e-3)
    assert [r[0].tokens for r in out] not in [[r[0].tokens for r in s] for s in singles]


def test_an_int8_ensemble_decodes_each_member_quantized(members, vocab):
    from aiayn.model.engine import Int8Transformer

    # every member gets its own int8 copy; the float members are left as they were
    translator = Translator(members, vocab, precision="int8")
    out = translator.generate(LINES, beam_size=4, max_len_b=8)
    copies = translator.decoding_models
    assert len(copies) == len(members) and all(c is not m for c, m in zip(copies, members))
    assert all(isinstance(c, Int8Transformer) for c in copies)
    assert not any(isinstance(m, Int8Transformer) for m in members)
    # an ensemble of the int8 copies, decoded at fp32, is the same search: the same outputs
    again = Translator(copies, vocab, precision="fp32").generate(LINES, beam_size=4, max_len_b=8)
    assert [r[0].tokens for r in out] == [r[0].tokens for r in again]


def test_bad_ensembles_are_refused(members, vocab):
    with pytest.raises(ValueError, match="at least one model"):
        Translator([], vocab, precision="fp32").generate(LINES)
    other = tiny_model(len(vocab) + 5, seed=1)
    with pytest.raises(ValueError, match="different output vocabularies"):
        Translator([members[0], other], vocab, precision="fp32").generate(LINES)
    with pytest.raises(ValueError, match="at least one step"):
        EnsembleStep([])


def test_an_ensemble_decode_leaves_each_member_in_the_mode_it_came_in(members, vocab):
    # decoding runs in eval mode (no dropout) and puts each member back as it came: members in
    # training mode must come back in training mode
    modes = [True, False, True]
    try:
        for model, mode in zip(members, modes):
            model.train(mode)
        Translator(members, vocab, precision="fp32").generate(LINES, beam_size=2, max_len_b=4)
        assert [m.training for m in members] == modes
    finally:
        for model in members:  # the module's fixture: eval mode, as tiny_model made it
            model.eval()


@pytest.mark.parametrize("int8_loss, chosen", [(0.0, "int8"), (0.2, "int8"), (0.3, "fp32")])
def test_a_run_records_int8_only_within_the_bleu_margin(monkeypatch, members, vocab, int8_loss,
                                                        chosen):
    """The pipeline's rule (aiayn.selection.check_reduced_precision): int8 becomes a run's
    default precision only where its val BLEU stays within 0.2 of fp32's and the machine runs
    it faster. The BLEU here is a stand-in that charges int8's output ``int8_loss`` points, so
    the rule, not the tiny model's luck, is what is tested; the outputs are the real ones."""
    import aiayn.precision as precision
    from aiayn.selection import check_reduced_precision

    translator = Translator(members, vocab, precision="fp32")
    decode = dataclasses.replace(translator.decode_config, beam_size=4, max_len_b=8)
    want = {p: Translator(members, vocab, precision=p).translate(
        LINES, preprocessed=True, **dataclasses.asdict(decode)) for p in ("fp32", "int8")}
    seen = []

    def bleu(hyps):
        seen.append(hyps)
        return 30.0 - (int8_loss if len(seen) == 2 else 0.0)  # fp32 is scored first

    monkeypatch.setattr(precision, "probe_int8_step", lambda model: 10.0)  # int8 is fastest
    got = check_reduced_precision(translator, LINES, bleu, decode)
    assert seen == [want["fp32"], want["int8"]]
    same = sum(a == b for a, b in zip(want["fp32"], want["int8"])) / len(LINES)
    assert got["identical"] == pytest.approx(same, abs=1e-4)
    assert got["chosen"] == chosen, got["reason"]
    assert (got["fp32"], got["int8"]) == (30.0, 30.0 - int8_loss)
    seen.clear()  # the caller's own fp32 output is used, not decoded again: the same verdict
    again = check_reduced_precision(translator, LINES, bleu, decode, fp32_hyps=want["fp32"])
    assert seen == [want["fp32"], want["int8"]] and again == got
    monkeypatch.setattr(precision, "probe_int8_step", lambda model: 0.5)  # int8 is slow
    monkeypatch.setattr(precision, "probe_cpu", lambda model, rows: (100.0, 1.0))
    seen.clear()
    assert check_reduced_precision(translator, LINES, bleu, decode)["chosen"] == "fp32"
