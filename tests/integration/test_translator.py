"""aiayn.Translator: what it loads, what it refuses, and what it computes (on small random-weight
checkpoints; the pipeline's tests show a finished run loading as the model it reports)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serving import tiny_checkpoint  # noqa: E402

from aiayn import Translator  # noqa: E402
from aiayn.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from aiayn.config import DecodeConfig  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.rundir import GENERATION_CONFIG, write_generation_config  # noqa: E402

LINES = ["Two dogs play in the snow.", "A man rides a bike.", "", "A woman reads."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("translator") / "ckpt")


def _second(checkpoint: Path, path: Path, seed: int = 1) -> Path:
    """Another random model with ``checkpoint``'s config and vocabulary."""
    _, cfg, vocab = load_checkpoint(checkpoint)
    torch.manual_seed(seed)
    return save_checkpoint(path, Transformer(cfg.model), cfg, vocab)


def test_a_path_that_is_no_model_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"nosuch: no such file or directory \(expected a "
                                        "checkpoint, a run directory or a Hugging Face Marian"):
        Translator.from_pretrained(tmp_path / "nosuch")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="folder: not a checkpoint, a run directory or a "
                                        "Hugging Face Marian directory"):
        Translator.from_pretrained(tmp_path / "folder")


def test_ensemble_members_of_other_text_are_refused_by_name(checkpoint, tmp_path):
    _, cfg, vocab = load_checkpoint(checkpoint)
    other = tmp_path / "lc"
    lc = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, preprocess="lc-norm-tok"))
    save_checkpoint(other, Transformer(cfg.model), lc, vocab)
    with pytest.raises(UserError, match=f"{other}: it reads data.preprocess = 'lc-norm-tok'"):
        Translator.from_pretrained([checkpoint, other])


def test_an_unfinished_run_loads_its_newest_checkpoint_and_says_so(checkpoint, tmp_path):
    run = tmp_path / "run"
    _second(checkpoint, run / "checkpoints" / "step-00000010", seed=1)
    newest = _second(checkpoint, run / "checkpoints" / "step-00000020", seed=2)
    said: list[str] = []
    translator = Translator.from_pretrained(run, warn=said.append)
    assert translator.source == [str(newest)]
    assert said == [f"{run}: training has not finished; loading its newest checkpoint, "
                    "step-00000020"]
    want = Translator.from_pretrained(newest).translate(LINES)
    assert translator.translate(LINES) == want


def test_a_finished_run_decodes_as_its_generation_config_says(checkpoint, tmp_path):
    """Members and search come from RUN/generation_config.json: an ensemble of the two members
    with the alpha chosen there, the same as loading the members by hand with that alpha."""
    run = tmp_path / "run"
    a = _second(checkpoint, run / "member-1" / "averaged", seed=3)
    b = _second(checkpoint, run / "member-2" / "averaged", seed=4)
    chosen = DecodeConfig(beam_size=3, alpha=1.4, max_len_a=0.5, max_len_b=6)
    path = write_generation_config(run, [a, "member-2/averaged"], chosen, weights="10",
                                   precision="fp32")
    record = json.loads(path.read_text())
    assert record["members"] == ["member-1/averaged", "member-2/averaged"]
    assert record["decode"]["alpha"] == 1.4 and record["weights"] == "10"
    translator = Translator.from_pretrained(run)
    assert translator.decode_config == chosen and len(translator.models) == 2
    assert translator.precision.chosen == "fp32"  # the run's recorded decoding precision
    by_hand = Translator.from_pretrained([a, b]).translate(LINES, beam_size=3, alpha=1.4)
    assert translator.translate(LINES) == by_hand
    with pytest.raises(ValueError, match="not inside"):
        write_generation_config(run, [checkpoint], chosen)
    # a record naming a member that is not there is refused, naming it
    record["members"] = ["member-3/averaged"]
    (run / GENERATION_CONFIG).write_text(json.dumps(record))
    with pytest.raises(UserError, match="member 'member-3/averaged' is not a checkpoint"):
        Translator.from_pretrained(run)


def test_score_is_the_log_probability_of_the_target(checkpoint, tmp_path):
    """score() is log P(target | source): the sum over the target's tokens and EOS of the
    log-probabilities that the search's own incremental step gives them, fed one at a time
    from the model's start token. An ensemble's score sums the log of its members' mean
    probability: a model twice scores as the model, and two models score at least the mean of
    their scores (Jensen)."""
    from aiayn.data.batching import pad_sources
    from aiayn.decoding import CachedStep

    translator = Translator.from_pretrained(checkpoint, precision="fp32")
    model, vocab = translator.models[0], translator.vocab
    sources, targets = LINES[:2], ["Zwei Hunde spielen.", "Ein Mann fährt Rad."]
    scores = translator.score(sources, targets)
    for source, target, got in zip(sources, targets, scores):
        ids = vocab.encode(target) + [2]
        with torch.no_grad():
            memory, mask = model.encode(pad_sources([vocab.encode(source) + [2]]))
            step = CachedStep.start(model, memory, mask)
            token, want = torch.tensor([step.start_id]), 0.0
            for t in ids:
                want += float(torch.log_softmax(step(token)[0].float(), -1)[t])
                token = torch.tensor([t])
        assert got == pytest.approx(want, abs=1e-4)

    second = _second(checkpoint, tmp_path / "second", seed=5)
    each = [Translator.from_pretrained(p, precision="fp32").score(sources, targets)
            for p in (checkpoint, second)]
    twice = Translator.from_pretrained([checkpoint, checkpoint], precision="fp32")
    assert twice.score(sources, targets) == pytest.approx(each[0], abs=1e-4)
    ensemble = Translator.from_pretrained([checkpoint, second], precision="fp32")
    both = ensemble.score(sources, targets)
    for k, got in enumerate(both):
        assert got >= (each[0][k] + each[1][k]) / 2 - 1e-4
        assert got != pytest.approx(each[0][k], abs=1e-3)
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        ensemble.score(sources, targets[:1])
    with pytest.raises(ValueError, match="target 1 is empty"):
        ensemble.score(sources[:1], [""])


def test_decode_overrides_are_checked(checkpoint):
    translator = Translator.from_pretrained(checkpoint)
    assert translator.decode_settings(alpha=1.0).alpha == 1.0
    assert translator.decode_settings(alpha=None) == translator.decode_config
    with pytest.raises(ValueError, match="unknown decode setting"):
        translator.decode_settings(beams=3)
    with pytest.raises(ValueError, match="beam_size"):
        translator.translate(LINES, beam_size=0)
